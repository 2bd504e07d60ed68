"""The Python package's layers, read from its source with ast: no import circle between its modules
or between its subpackages, and the settings at the bottom (they import nothing of gpumem's but
themselves and the compiled module). Every import counts, those inside functions too: a circle
through a deferred import is still a circle a reader has to untangle."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "gpumem"
BOTTOM = "gpumem.settings"  # imports only itself and ALWAYS_BELOW
ALWAYS_BELOW = {"gpumem._C"}  # the compiled module, below every Python module


def module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("gpumem",) + path.relative_to(PACKAGE).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The gpumem modules `name` imports. `from gpumem import x` imports gpumem.x where that is a
    module; the top package itself, which every import of a submodule runs first, is left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {target for target in found
            if target != "gpumem" and (target in modules or target in ALWAYS_BELOW) and target != name}


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    return {name: imports_of(name, path, set(names)) for name, path in names.items()}


def group_of(name: str) -> str:
    """A module's subpackage (gpumem.monitoring for gpumem.monitoring.metrics), else the module."""
    parts = name.split(".")
    if len(parts) == 1:
        return name
    subpackage = ".".join(parts[:2])
    return subpackage if len(parts) > 2 or (PACKAGE / parts[1]).is_dir() else name


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of `graph` as the nodes along it, first repeated at the end; [] if none."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        state[node] = "done"
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_no_module_imports_another_that_imports_it_back():
    found = circle(import_graph())
    assert not found, " imports ".join(found)


def test_no_subpackage_imports_another_that_imports_it_back():
    groups: dict[str, set[str]] = {}
    for name, targets in import_graph().items():
        groups.setdefault(group_of(name), set()).update(group_of(t) for t in targets if group_of(t) != group_of(name))
    found = circle(groups)
    assert not found, " imports ".join(found)


def test_the_settings_import_nothing_above_them():
    graph = import_graph()
    settings = [name for name in graph if name == BOTTOM or name.startswith(BOTTOM + ".")]
    assert settings, f"no {BOTTOM} package"
    above = {name: sorted(t for t in graph[name] if not (t == BOTTOM or t.startswith(BOTTOM + ".") or t in ALWAYS_BELOW))
             for name in settings}
    assert {name: targets for name, targets in above.items() if targets} == {}, "a setting imports a feature"


def test_the_circle_finder_finds_a_circle():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) == []
