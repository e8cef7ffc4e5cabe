"""Counting restarts when a worker is lost while the group restarts (no Ray: the events alone)."""

from __future__ import annotations

from raytrain_ft.recovery import CONSEQUENCE, GROUP_START, KILLED, cause_text, failures, recovery_rows, totals


def failure(t: float, causes: dict, **fields) -> dict:
    return {
        "time": t,
        "kind": "failure",
        "causes": causes,
        "last_step": 6,
        "step_time_s": 0.5,
        "world_size": 2,
        **fields,
    }


def test_a_failure_during_the_group_start_is_a_restart_of_its_own():
    events = [
        {"time": 0.0, "kind": "attempt_start", "resumed_from": 0, "world_size": 2},
        failure(10.0, {"1": KILLED}),
        failure(10.1, {"0": CONSEQUENCE}),  # the same failure, reported for the other rank
        failure(20.0, {GROUP_START: "a worker died while the worker group started (killed)"}, source=GROUP_START),
        {"time": 30.0, "kind": "attempt_start", "resumed_from": 5, "world_size": 2},
    ]
    merged = failures(events)
    assert [f["causes"] for _, f in merged] == [{"1": KILLED, "0": CONSEQUENCE}, events[3]["causes"]]
    assert totals(recovery_rows(events))["restarts"] == 2
    assert [r["resumed_from"] for r in recovery_rows(events)] == [5, 5]
    assert cause_text(events[3]["causes"]).startswith("the worker group start: a worker died")
