"""A pytest plugin for tools/torch_tests.py: one JSON line per event, written as it happens.

Loaded with `-p torch_tests_log` (tools/ on PYTHONPATH). TORCH_TESTS_LOG names the file it appends
to; a line is flushed before the test it announces runs, so a test that kills the process leaves
its "start" line without a "teardown" report, and the runner can name it. TORCH_TESTS_COLLECT (a
file) makes collection write the test ids there; TORCH_TESTS_ONLY (a file of ids, one a line) keeps
only those tests, in collection order.
"""
from __future__ import annotations

import json
import os

_MAX_TEXT = 2000  # of a failure's text: enough for its last lines, bounded whatever a test prints


def _write(event: dict) -> None:
    path = os.environ.get("TORCH_TESTS_LOG")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(event) + "\n")


def pytest_collection_modifyitems(config, items):
    only = os.environ.get("TORCH_TESTS_ONLY")
    if not only:
        return
    with open(only, encoding="utf-8") as f:
        wanted = {line.strip() for line in f if line.strip()}
    kept = [item for item in items if item.nodeid in wanted]
    dropped = [item for item in items if item.nodeid not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_collection_finish(session):
    path = os.environ.get("TORCH_TESTS_COLLECT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(item.nodeid + "\n" for item in session.items)


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "id": nodeid})


def pytest_runtest_logreport(report):
    event = {"event": "report", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
             "xfail": hasattr(report, "wasxfail"), "seconds": round(report.duration, 3)}
    if report.failed or report.skipped:
        event["text"] = str(report.longreprtext)[-_MAX_TEXT:]
    _write(event)
