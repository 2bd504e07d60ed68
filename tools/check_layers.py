#!/usr/bin/env python3
"""The layers of csrc/ (docs/design.md), checked from the #include lines and the build's lists.

    core (no torch, no CUDA, no sharing) -> backends -> torch adapter -> Python module
                                         -> sharing ------------------^

A file may include only the layers its directory is allowed below; the Python module reaches the
core only through its public face (core/api.h), and includes no source file of any layer. The core
library that CMakeLists.txt builds holds exactly csrc/core/*.cpp, what setup.py's glob compiles
for the core, and no backend.

Usage: tools/check_layers.py [ROOT]   (ROOT: the repository, by default this script's). Prints one
line per breach and exits 1 if there is any, 0 otherwise. CTest runs it as the test "layers".
"""
from __future__ import annotations

import pathlib
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)

# directory -> what its files may include ("core/" any core header; "core/api.h" that one only;
# "backends/*.h" a backend's headers, never its sources).
ALLOWED = {
    "core": ("core/",),
    "backends": ("core/", "backends/*.h"),
    "sharing": ("core/", "sharing/"),
    "torch": ("core/", "torch/", "backends/*.h"),
    "python": ("core/api.h", "torch/*.h", "sharing/*.h", "backends/*.h"),
}


def allowed(target: str, rules: tuple) -> bool:
    for rule in rules:
        if rule.endswith("/*.h"):
            if target.startswith(rule[:-3]) and target.endswith(".h"):
                return True
        elif rule.endswith("/"):
            if target.startswith(rule):
                return True
        elif target == rule:
            return True
    return False


def include_breaches(root: pathlib.Path) -> list[str]:
    breaches = []
    for layer, rules in ALLOWED.items():
        for path in sorted((root / "csrc" / layer).glob("*.[ch]*")):
            for target in INCLUDE.findall(path.read_text(errors="replace")):
                if not allowed(target, rules):
                    breaches.append(f"{path.relative_to(root)} includes {target}: layer {layer} may include only "
                                    f"{', '.join(rules)}")
    return breaches


def core_library_breaches(root: pathlib.Path) -> list[str]:
    cmake = (root / "CMakeLists.txt").read_text()
    match = re.search(r"add_library\(gpumem_core STATIC(.*?)\)", cmake, re.DOTALL)
    if not match:
        return ["CMakeLists.txt: no add_library(gpumem_core STATIC ...)"]
    listed = set(match.group(1).split())
    globbed = {str(p.relative_to(root)) for p in (root / "csrc" / "core").glob("*.cpp")}
    breaches = [f"CMakeLists.txt: gpumem_core builds {name}, which is not a core source" for name in
                sorted(listed - globbed)]
    breaches += [f"CMakeLists.txt: gpumem_core misses {name}, which setup.py builds" for name in
                 sorted(globbed - listed)]
    return breaches


def main(argv: list[str]) -> int:
    root = pathlib.Path(argv[1]) if len(argv) > 1 else pathlib.Path(__file__).resolve().parents[1]
    breaches = include_breaches(root) + core_library_breaches(root)
    for breach in breaches:
        print(breach)
    return 1 if breaches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
