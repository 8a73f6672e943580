"""The layout's rules, checked on the source: imports flow cli -> engines -> discovery ->
planner -> errors, and no product module imports itself back through others (lazy imports
included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each may import only those before it.
PACKAGES = ("errors", "planner", "discovery", "engines", "cli")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Product modules `name` imports anywhere in its body (TYPE_CHECKING and lazy too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = product_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def test_packages_import_only_downwards() -> None:
    rank = {package: index for index, package in enumerate(PACKAGES)}
    upward = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        for target in targets
        if rank[target.split(".")[0]] > rank[module.split(".")[0]]
    ]
    assert not upward, upward


def test_no_import_circles() -> None:
    edges = graph()
    # A package's __init__ importing its own modules is how Python packages work, not a circle.
    for name in edges:
        edges[name] = {t for t in edges[name] if not name.startswith(t + ".")}
    circles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                circles.append(" -> ".join([*trail[trail.index(target):], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert not circles, circles
