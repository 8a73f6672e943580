"""Running a plan on the cluster: launch, supervision and re-planning, memory pressure."""
