"""Preemption under replica recovery on a 2-node `ray.cluster_utils.Cluster` at exact fit
(`tests/scenarios/replica_preemption.py`): the worker node is drained with reason preemption and
a deadline; its replica leaves the quorum after a committed step, the other trains on without a
restart and without a lost step, and the replacement Ray Train starts once a node returns heals and
joins. Restart recovery's preemption is pinned by
`test_elastic.py::test_preemption_then_shrink_on_node_loss_then_grow_back`."""

from __future__ import annotations

from pathlib import Path

import pytest
from scenarios.replica_preemption import DRAIN_AFTER, STEPS, replica_preemption_config

from conftest import assert_resumed, events, expected_step_ids, run_scenario
from raytrain_ft.cli import main as cli
from raytrain_ft.core.run_folder import replica_final_file
from raytrain_ft.data.audit import read_audit


@pytest.mark.exclusive
def test_a_drained_replica_leaves_at_a_step_boundary_and_is_replaced_without_a_restart_or_a_lost_step(
    tmp_path, dataset, capsys
):
    outcome = run_scenario("replica_preemption.py", dataset, str(tmp_path))
    assert outcome["finished"]
    cfg, run_id = replica_preemption_config(dataset, str(tmp_path)), outcome["run_id"]
    uri = cfg.tracking.uri

    # one preemption event, by the drained node's replica, at the step boundary after the notice
    [p] = events(uri, run_id, "preemption")
    doomed, survivor = outcome["replica"], 1 - outcome["replica"]
    assert (p["node"], p["rank"], p["checkpoint"]) == (outcome["node"], doomed, False)  # the survivor holds it
    assert outcome["drained_at"] <= p["notice_time"] <= outcome["drain_returned"] + 2  # polled every second
    assert abs(p["deadline"] - (outcome["drained_at"] + outcome["deadline_s"])) < 5
    assert p["step_saved"] > DRAIN_AFTER and 0 < p["notice_to_committed_s"] < p["deadline"] - p["notice_time"]
    # no restart: one attempt; the survivor kept its process; the doomed replica was replaced on the
    # node that joined after the drained one went, and joined the quorum
    assert_resumed(uri, run_id, [0])
    before, after = outcome["before"], outcome["after"]
    assert after[str(survivor)]["pid"] == before[str(survivor)]["pid"]
    assert after[str(doomed)]["started_at"] > p["time"] and after[str(doomed)]["node_id"] != outcome["node"]
    [joined] = events(uri, run_id, "replica_joined")
    assert joined["replica"] == doomed and joined["step"] > p["step_saved"] and joined["participants"] == 2
    # leaving at a boundary lost no step: every step committed the first time it was trained
    assert events(uri, run_id, "step_not_committed") == []
    # every step trained its global batch's sample ids, each once, whoever took part
    audit = read_audit(str(tmp_path / "runs" / "replica-preemption")).to_pydict()
    trained: dict[int, list[int]] = {}
    for step, sample in zip(audit["step"], audit["sample_id"], strict=True):
        trained.setdefault(step, []).append(sample)
    assert {s: sorted(ids) for s, ids in trained.items()} == expected_step_ids(dataset, STEPS, 8)
    # both replicas ended at the last step, bitwise equal
    root = str(tmp_path / "runs" / "replica-preemption")
    digests = [Path(replica_final_file(root, i)).read_text() for i in (0, 1)]
    assert digests[0] == digests[1] and f'"step": {STEPS}' in digests[0]
    # `raytrain-ft history` shows the preemption
    assert cli(["history", run_id, "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert "Preemptions" in out and outcome["node"][:12] in out
