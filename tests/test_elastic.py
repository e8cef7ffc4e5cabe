"""Elastic training on a 3-node local cluster: a node gets a preemption notice, is removed, and comes back;
the run trains at 3 workers (a global batch of 8 over 3 ranks: 2/3/3 sequences) and at 2, with the
memory tier on (a resize restores the durable checkpoint)."""

from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from scenarios.elastic import elastic_config

from conftest import (
    COMMITTED,
    assert_resumed,
    events,
    expected_step_ids,
    metric_by_step,
    run_scenario,
    uninterrupted_lrs,
)
from raytrain_ft.data.audit import read_audit

pytestmark = pytest.mark.exclusive


def metric_values(uri: str, run_id: str, key: str) -> list[float]:
    """Every logged value of `key`, in logging order."""
    history = MlflowClient(uri).get_metric_history(run_id, key)
    return [m.value for m in sorted(history, key=lambda m: m.timestamp)]


def test_preemption_then_shrink_on_node_loss_then_grow_back(tmp_path, dataset):
    outcome = run_scenario("elastic.py", dataset, str(tmp_path))
    assert outcome["finished"]
    # the group shrank to 2 before the node came back, then grew to 3 (each attempt logs its world size once)
    assert outcome["world_sizes_before_add"] == [3, 2]
    assert outcome["world_sizes"] == [3, 2, 3]
    # the preemption notice made every rank save the next step and wait for its registration (one
    # event, by the drained node's worker); the shrunk group resumed from it (nothing lost); the
    # grown-back group resumed from a later commit, not from 0
    cfg, run_id = elastic_config(dataset, str(tmp_path)), outcome["run_id"]
    [p] = events(cfg.tracking.uri, run_id, "preemption")
    drained = outcome["drained"]
    assert p["node"] == drained["node"] and p["checkpoint"] is True
    assert drained["at"] <= p["notice_time"] <= drained["returned"] + 2  # polled every second
    assert abs(p["deadline"] - (drained["at"] + drained["deadline_s"])) < 5
    assert 0 < p["notice_to_committed_s"] < p["deadline"] - p["notice_time"]
    preempted_at = p["step_saved"]
    assert preempted_at > 10
    attempts = assert_resumed(cfg.tracking.uri, run_id, [0, preempted_at, COMMITTED])
    assert [a["world_size"] for a in attempts] == [3, 2, 3]  # start, node loss, node back
    assert attempts[-1]["resumed_from"] >= preempted_at
    # with the memory tier on, the shrunk group restored the durable checkpoint: it passed over the
    # copies of a step newer than it that the group of 3 had committed before the node went (the
    # scenario waits for one; it then deleted them, a trajectory left), and every copy passed over was
    # of another world size. The grown-back group restored the durable checkpoint too, or, when the
    # shrunk group had committed nothing newer, the group of 3's own copy of that same step (its world
    # size again, the same state: an equal step is read from memory)
    restored = [a["restored_from"] for a in attempts]
    assert restored[:2] == ["", "storage"]
    assert restored[2] == "storage" or (
        restored[2] in ("memory", "peer") and attempts[2]["resumed_from"] == preempted_at
    )
    skipped = [e["reason"] for e in events(cfg.tracking.uri, run_id, "memory_copy_skipped")]
    assert any("saved at {'world_size': 3" in r and "now {'world_size': 2" in r for r in skipped), skipped
    assert all("'world_size': 3" in r and "'world_size': 2" in r for r in skipped), skipped
    # the split's balance at each size: 8 / (3 x 3) at W=3 (the sequence-level bound), even at W=2
    assert metric_values(cfg.tracking.uri, run_id, "batch_balance") == [8 / 9, 1.0, 8 / 9]
    # the split changed twice; the LR schedule continued as in an uninterrupted run
    assert metric_by_step(cfg, run_id, "train/lr") == uninterrupted_lrs(cfg.train)

    audit = read_audit(str(tmp_path / "runs" / "elastic"))
    steps, ids = audit.column("step").to_numpy(), audit.column("sample_id").to_numpy()
    got = {int(s): sorted(ids[steps == s].tolist()) for s in np.unique(steps)}
    assert got == expected_step_ids(dataset, cfg.train.max_steps, 8)
