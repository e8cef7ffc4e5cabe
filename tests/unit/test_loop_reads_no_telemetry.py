"""The loop writes to its recorder and never decides from it (issue: telemetry is a sink).

Read from the syntax trees of `raytrain_ft/training/loop.py` and of the modules holding the rest of
`Trainer`'s code (its construction, `run_components`; its saves and commits, `commits`; its attempt
record, `telemetry.attempt`; its members leaving after a step, `resilience.leaving`), so a branch
that comes back is red without a
run: no `if`/`while`/conditional expression/`and`/`or` tests a recorder, and nothing calls a
recorder's (or the tracking store's) read methods. The run's past reaches the loop through
`Session.history()`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import raytrain_ft.resilience.leaving
import raytrain_ft.telemetry.attempt
import raytrain_ft.training.commits
import raytrain_ft.training.loop
import raytrain_ft.training.run_components

MODULES = (
    raytrain_ft.training.loop,
    raytrain_ft.training.run_components,
    raytrain_ft.training.commits,
    raytrain_ft.telemetry.attempt,
    raytrain_ft.resilience.leaving,
)
NODES = [n for m in MODULES for n in ast.walk(ast.parse(Path(m.__file__).read_text()))]
READS = {"events", "load_history", "latest_metrics", "get_run", "get_metric_history", "search_runs"}


def names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }


def test_no_branch_of_the_loop_tests_a_recorder():
    tests = [n.test for n in NODES if isinstance(n, (ast.If, ast.While, ast.IfExp))]
    tests += [n for n in NODES if isinstance(n, ast.BoolOp)]
    assert tests, "the loop has no branches at all: the parse is wrong"
    offending = [ast.unparse(t) for t in tests if any("recorder" in name for name in names_in(t))]
    assert offending == []


def test_the_loop_reads_nothing_back_from_tracking():
    calls = [n for n in NODES if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert calls
    assert sorted({c.func.attr for c in calls} & READS) == []
    imported = {a.name for n in NODES if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    imported |= {n.module or "" for n in NODES if isinstance(n, ast.ImportFrom)}
    assert not any(
        name.split(".")[0] in ("mlflow", "raytrain_ft.telemetry.tracking") or name == "raytrain_ft.telemetry.tracking"
        for name in imported
    )
