"""`straggler.action: exclude` on a `ray.cluster_utils.Cluster` (`tests/scenarios/straggler_exclusion.py`):
rank 1 is slow, flagged, and excluded `EXCLUDE_AFTER` steps after its flag, at a step boundary, with
nothing lost; one real-Ray run per recovery mode, sharing `assert_excluded`. The decisions themselves
(when a rank is excluded, the next group's scaling) are tests/unit/test_exclusion_decisions.py."""

from __future__ import annotations

import pytest
from scenarios.straggler_exclusion import EXCLUDE_AFTER, STEPS, exclusion_config

from conftest import assert_resumed, events, expected_step_ids, run_scenario
from raytrain_ft.data.audit import read_audit

pytestmark = pytest.mark.exclusive


def excluded_run(mode: str, dataset: str, tmp_path) -> dict:
    outcome = run_scenario("straggler_exclusion.py", mode, dataset, str(tmp_path))
    assert outcome["finished"]
    return outcome


def assert_excluded(mode: str, outcome: dict, dataset: str, tmp_path) -> tuple[dict, int]:
    """Rank 1's node, and it alone, was excluded once, after the step its `straggler` event names,
    EXCLUDE_AFTER steps after its flag; every step trained its global batch once. Returns the
    exclusion record and its step."""
    cfg = exclusion_config(mode, dataset, str(tmp_path))
    uri, run_id = cfg.tracking.uri, outcome["run_id"]
    [excluded] = outcome["exclusions"]
    slow_node = outcome["first"]["1"]["node_id"]  # where rank 1 ran before the exclusion
    assert (excluded["rank"], excluded["node"]) == (1, slow_node)
    flag, exclusion = events(uri, run_id, "straggler")[:2]
    assert (flag["rank"], flag["node"], flag["action"]) == (1, slow_node, "warn")
    assert (exclusion["rank"], exclusion["node"], exclusion["action"]) == (1, slow_node, "exclude")
    step = exclusion["step"]
    assert step == excluded["step"] == flag["step"] + EXCLUDE_AFTER == exclusion["flagged_step"] + EXCLUDE_AFTER
    # every step's sample ids, each once: no committed step lost, none trained twice
    audit = read_audit(str(tmp_path / "runs" / cfg.run.name)).to_pydict()
    trained: dict[int, list[int]] = {}
    for s, sample in zip(audit["step"], audit["sample_id"], strict=True):
        trained.setdefault(s, []).append(sample)
    assert {s: sorted(ids) for s, ids in trained.items()} == expected_step_ids(dataset, STEPS[mode], 8)
    return excluded, step


def test_restart_mode_ends_the_attempt_at_the_exclusion_step_and_resumes_without_the_slow_node(tmp_path, dataset):
    outcome = excluded_run("restart", dataset, tmp_path)
    excluded, step = assert_excluded("restart", outcome, dataset, tmp_path)
    cfg = exclusion_config("restart", dataset, str(tmp_path))
    # the exclusion is no failure: the attempt ended with step `step` committed and the next one
    # resumed from it at 2 workers, none on the excluded node
    attempts = assert_resumed(cfg.tracking.uri, outcome["run_id"], [0, step])
    assert [a["world_size"] for a in attempts] == [3, 2]
    assert events(cfg.tracking.uri, outcome["run_id"], "failure") == []
    assert sorted(outcome["last"]) == ["0", "1"]
    assert excluded["node"] not in {w["node_id"] for w in outcome["last"].values()}


def test_replica_mode_replaces_the_slow_replica_after_it_left_the_quorum_at_a_step_boundary(tmp_path, dataset):
    outcome = excluded_run("replica", dataset, tmp_path)
    excluded, step = assert_excluded("replica", outcome, dataset, tmp_path)
    cfg = exclusion_config("replica", dataset, str(tmp_path))
    uri, run_id = cfg.tracking.uri, outcome["run_id"]
    # no restart: the survivor kept its process; replica 1 was replaced (Ray Train 2.60 puts the
    # replacement in the replica's placement-group bundle: on the same node, docs/stragglers.md) and
    # joined the quorum after the exclusion; leaving at the boundary lost no step
    assert_resumed(uri, run_id, [0])
    first, last = outcome["first"], outcome["last"]
    assert last["0"]["pid"] == first["0"]["pid"]
    assert last["1"]["pid"] != first["1"]["pid"] and last["1"]["started_at"] > excluded["time"]
    assert last["1"]["node_id"] == excluded["node"]
    [failure] = events(uri, run_id, "failure")
    assert "excluded as a straggler" in failure["causes"]["1"]
    [joined] = events(uri, run_id, "replica_joined")
    assert joined["replica"] == 1 and joined["step"] > step and joined["participants"] == 2
    assert events(uri, run_id, "step_not_committed") == []
