"""The package's structure, as drawn from its imports (every `import`, lazy ones inside functions
included): no import cycles, every import goes to the same floor or a lower one, no module
imports another module's `_private` names, and the root of `vlmcp/` holds only the entry points,
the device choice and the errors."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vlmcp"
#: Floors of the house, lowest first: a module may import its own floor and the ones below.
FLOORS = {
    "vlmcp.errors": 0, "vlmcp.device": 0,
    "vlmcp.config": 1, "vlmcp.data": 1, "vlmcp.parallel": 1,
    # the engine clients speak HTTP with the standard library: the trainer pushes through them
    "vlmcp.model": 2, "vlmcp.engine": 2,
    "vlmcp.training": 3,
    "vlmcp.bench": 4, "vlmcp.demo": 4, "vlmcp.rl": 4, "vlmcp.cli": 4, "vlmcp.__main__": 4,
}
ROOT_MODULES = {"__init__.py", "__main__.py", "cli.py", "device.py", "errors.py"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(vlmcp module imported, the names taken from it) of every import statement in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.startswith("vlmcp")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmcp"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in modules:
                    found.append((submodule, []))
                else:
                    found.append((node.module, [alias.name]))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {target for target, _ in _imports(path, modules) if target != name}
            for name, path in modules.items()}


def _floor(module: str) -> int:
    return next(floor for prefix, floor in FLOORS.items()
                if module == prefix or module.startswith(prefix + "."))


def test_the_package_has_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert cycles == []


def test_every_import_goes_to_the_same_floor_or_a_lower_one():
    upward = [f"{source} -> {target}" for source, targets in _graph().items() for target in targets
              if target != "vlmcp" and _floor(target) > _floor(source)]
    assert upward == []


def test_no_module_imports_a_private_name_of_another():
    modules = _modules()
    private = [f"{name} takes {taken} from {target}"
               for name, path in modules.items()
               for target, names in _imports(path, modules) if target != name
               for taken in names if taken.startswith("_")]
    assert private == []


def test_the_package_root_holds_only_entry_points_device_and_errors():
    root_files = {path.name for path in PACKAGE.glob("*.py")}
    assert root_files == ROOT_MODULES
    assert set(FLOORS) >= {f"vlmcp.{path.name}" for path in PACKAGE.iterdir()
                           if path.is_dir() and (path / "__init__.py").exists()}
