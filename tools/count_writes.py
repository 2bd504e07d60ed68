#!/usr/bin/env python3
"""Writes to public data members from outside their owner (issue 41, item 1), found by clang-query in
every csrc/ translation unit of a compile database.

A write is an assignment, a compound assignment, ++ or -- whose left side names a public data member
of a type declared in csrc/core or csrc/sharing. It counts when it is made outside the type's own
files (the header that declares the type and the .cpp of the same name), on an object the writing
code does not own: one reached through a pointer, a reference or a member of `this`, not a local
value it is filling in (an OomInfo being built, a config being assembled). A member passed to a
function by non-const reference, or changed by its own methods, is not a write here.

Usage: tools/count_writes.py [-v] [BUILD_DIR]
  BUILD_DIR: where to configure a build for its compile database (default build/writes; configured
  only, nothing is compiled). Prints "outside writes N", then one line per type written to: its
  writes and the files they are in; -v adds each site. Needs clang-query (Debian's clang-tools).
"""
from __future__ import annotations

import collections
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# clang-query reads one command a line.
QUERY = r"""
set output diag
set bind-root false
let pubfield fieldDecl(isPublic(), isExpansionInFileMatching("csrc/(core|sharing)/"), hasParent(recordDecl().bind("type"))).bind("field")
let localvar varDecl(hasLocalStorage(), unless(hasType(referenceType())))
let localref ignoringParenImpCasts(declRefExpr(to(localvar)))
let owned ignoringParenImpCasts(anyOf(localref, memberExpr(unless(isArrow()), hasObjectExpression(localref))))
let target ignoringParenImpCasts(memberExpr(member(pubfield), unless(allOf(unless(isArrow()), hasObjectExpression(owned)))).bind("write"))
let written expr(anyOf(binaryOperator(isAssignmentOperator(), hasLHS(target)), cxxOperatorCallExpr(isAssignmentOperator(), hasArgument(0, target)), unaryOperator(anyOf(hasOperatorName("++"), hasOperatorName("--")), hasUnaryOperand(target))))
match expr(written, unless(hasAncestor(functionDecl(isImplicit()))))
"""

BIND = re.compile(r'^(\S+?):(\d+):\d+: note: "(\w+)" binds here', re.M)
TYPE = re.compile(r"\b(?:struct|class|union)\s+(?:alignas\([^)]*\)\s+)?(\w+)")
FIELD = re.compile(r"(\w+)\s*(?:\[[^\]]*\])?\s*(?:=[^;]*|\{[^;]*\})?;")


def line_of(path: str, line: int) -> str:
    return pathlib.Path(path).read_text().splitlines()[line - 1].split("//")[0]


def compile_database(build: pathlib.Path) -> list[str]:
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                    "-DGPUMEM_BENCHMARKS=OFF"], check=True, stdout=subprocess.DEVNULL)
    entries = json.loads((build / "compile_commands.json").read_text())
    return sorted({e["file"] for e in entries if str(ROOT / "csrc") in e["file"]})


def writes(build: pathlib.Path) -> set[tuple[str, str, str, int]]:
    """(type, field, writing file, line) of each counted write."""
    sources = compile_database(build)
    query = build / "count_writes.query"
    query.write_text(QUERY)
    run = subprocess.run(["clang-query", "-p", str(build), "-f", str(query)] + sources,
                         capture_output=True, text=True)
    out = run.stdout + run.stderr
    if run.returncode != 0:
        sys.exit(f"count_writes.py: clang-query failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    failed = re.findall(r"^(/\S+?):\d+:\d+: error: ", out, re.M)
    broken = sorted({str(pathlib.Path(path).relative_to(ROOT)) for path in failed})
    if broken:
        print(f"count_writes.py: clang-query could not parse all of {', '.join(broken)}; writes there may be missed",
              file=sys.stderr)
    found = set()
    for match in out.split("\nMatch #")[1:]:
        bound = {name: (path, int(line)) for path, line, name in BIND.findall(match)}
        if not {"type", "field", "write"} <= bound.keys():
            continue
        type_name = TYPE.search(line_of(*bound["type"]))
        field_name = FIELD.search(line_of(*bound["field"]))
        declared, (path, line) = pathlib.Path(bound["field"][0]), bound["write"]
        if pathlib.Path(path).with_suffix("") == declared.with_suffix(""):
            continue  # the type's own files
        found.add((type_name.group(1) if type_name else "?", field_name.group(1) if field_name else "?",
                   str(pathlib.Path(path).relative_to(ROOT)), line))
    return found


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    build = pathlib.Path(args[0]).resolve() if args else ROOT / "build" / "writes"
    found = writes(build)
    print(f"outside writes {len(found)}")
    by_type = collections.defaultdict(list)
    for type_name, field, path, line in sorted(found):
        by_type[type_name].append((field, path, line))
    for type_name, sites in sorted(by_type.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        files = sorted({path for _, path, _ in sites})
        print(f"  {type_name} {len(sites)}: {', '.join(files)}")
        if verbose:
            for field, path, line in sites:
                print(f"    {path}:{line} {field}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
