"""Table tests of the pure planner."""
