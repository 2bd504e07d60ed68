"""Every import path the docs show still works: each `import gpumem...`, `from gpumem... import ...`
and dotted name `gpumem.x.y` in README.md and docs/ (the notebook's cells too) imports or resolves,
so a module moved inside the package keeps the paths users have written. The list is read from the
docs each run: a name documented later is covered without touching this test.

Names with a private part (`gpumem._something`) are pointers into the code for readers, not paths
users import, and are left out; gpumem._C, the compiled module the docs name for its errors, is kept.
"""
from __future__ import annotations

import importlib
import json
import pathlib
import re
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*.ipynb"))]
# Dotted words in the docs that are no Python path, with where they come from.
NOT_PATHS = {
    "gpumem.device": "a key of `gpumem top --json`'s document (docs/monitoring.md)",
}
_DOTTED = re.compile(r"(?<![\w./-])gpumem(?:\.[A-Za-z_]\w*)+")
_FROM = re.compile(r"^\s*from (gpumem(?:\.\w+)*) import \(?([\w ,]+)", re.M)
_IMPORT = re.compile(r"^\s*import (gpumem(?:\.\w+)*)", re.M)
_KEPT_PRIVATE = {"_C"}


def doc_text(path: pathlib.Path) -> str:
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in json.loads(path.read_text())["cells"])
    return path.read_text()


def documented_names() -> dict[str, str]:
    """Each documented path (dotted, "gpumem.a.b"), with a file that shows it."""
    names: dict[str, str] = {}
    for path in DOCS:
        text = doc_text(path)
        found = set(_DOTTED.findall(text)) | set(_IMPORT.findall(text))
        for module, imported in _FROM.findall(text):
            found.update(f"{module}.{name.split(' as ')[0].strip()}" for name in imported.split(",") if name.strip())
        for name in found:
            names.setdefault(name, path.name)
    return {name: where for name, where in sorted(names.items())
            if name not in NOT_PATHS and all(not part.startswith("_") or part in _KEPT_PRIVATE
                                             for part in name.split(".")[1:])}


def resolve(name: str) -> object:
    """What `name` names after `import gpumem`: its attributes, one after another."""
    value = importlib.import_module("gpumem")
    for attribute in name.split(".")[1:]:
        value = getattr(value, attribute)
    return value


def module_paths(name: str) -> list[str]:
    """The prefixes of `name` that name a module (gpumem.metrics for gpumem.metrics.Collector):
    paths a user may import by (`import gpumem.metrics`, `from gpumem.metrics import Collector`)."""
    parts = name.split(".")
    return [".".join(parts[:cut]) for cut in range(1, len(parts) + 1)
            if isinstance(resolve(".".join(parts[:cut])), types.ModuleType)]


DOCUMENTED = documented_names()


def test_the_docs_name_the_paths_users_write():
    # The reader above finds them: a regression in it would pass every test below vacuously.
    for name in ("gpumem.set_limit", "gpumem.sharing.status", "gpumem.timeline.start", "gpumem.serve_metrics",
                 "gpumem.snapshot_file.load", "gpumem.replay.min_limit", "gpumem.metrics.Collector", "gpumem.replay"):
        assert name in DOCUMENTED, name


@pytest.mark.parametrize("name", DOCUMENTED, ids=list(DOCUMENTED))
def test_a_documented_name_resolves(name):
    try:
        resolve(name)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"{name}, in {DOCUMENTED[name]}, does not resolve: {error}")


def test_each_documented_module_imports_by_its_path_in_a_fresh_interpreter():
    """`import gpumem.x` for every module a documented name passes through (gpumem.metrics for
    gpumem.metrics.Collector; `from gpumem.x import y` imports the same), first thing in a new
    program: nothing imported before may make it work."""
    modules = sorted({path for name in DOCUMENTED for path in module_paths(name)})
    assert "gpumem.metrics" in modules and "gpumem.replay" in modules
    code = "import importlib, sys; importlib.import_module(sys.argv[1])"
    for name in modules:  # each alone: one path imported must not be what makes the next work
        completed = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=120)
        assert completed.returncode == 0, f"import {name}: {completed.stderr[-2000:]}"
