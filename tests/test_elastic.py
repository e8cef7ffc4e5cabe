"""Elastic training on a 2-node local cluster: a node gets a preemption notice, is removed, and comes back."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from scenarios.elastic import elastic_config

from conftest import COMMITTED, REPO, assert_resumed, metric_by_step, scenario_outcome, uninterrupted_lrs
from raytrain_ft.data.audit import read_audit
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import EpochOrder, steps_per_epoch


def expected_step_ids(dataset: str, steps: int, global_batch_size: int) -> dict[int, list[int]]:
    """What exactly-once means, computed from the order alone: step s takes global batch s of its epoch."""
    m = load_manifest(dataset)
    per_epoch = steps_per_epoch(m, global_batch_size, micro_batch_size=2)
    out = {}
    for epoch in range((steps - 1) // per_epoch + 1):
        order = EpochOrder(dataset, m, 0, epoch, global_batch_size, micro_batch_size=2)
        ids = order.step_sample_ids(0, per_epoch)
        for i in range(per_epoch):
            out[epoch * per_epoch + i + 1] = sorted(ids[i].tolist())
    return {s: out[s] for s in range(1, steps + 1)}


def test_preemption_then_shrink_on_node_loss_then_grow_back(tmp_path, dataset):
    r = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "scenarios", "elastic.py"), dataset, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert r.returncode == 0, r.stderr[-4000:]
    outcome = scenario_outcome(r.stdout)
    assert outcome["events"] == ["removed", "added"] and outcome["finished"]
    # the preemption notice made a just-in-time checkpoint and the shrunk group resumed from it
    # (nothing lost); the grown-back group resumed from a later commit, not from 0
    [preempted_at] = outcome["preemption_steps"]
    assert preempted_at > 20
    cfg, run_id = elastic_config(dataset, str(tmp_path)), outcome["run_id"]
    attempts = assert_resumed(cfg.tracking.uri, run_id, [0, preempted_at, COMMITTED])
    assert [a["world_size"] for a in attempts] == [2, 1, 2]  # start, node loss, node back
    assert attempts[-1]["resumed_from"] >= preempted_at
    # grad_accum_steps changed twice; the LR schedule continued as in an uninterrupted run
    assert metric_by_step(cfg, run_id, "lr") == uninterrupted_lrs(cfg.train)

    audit = read_audit(str(tmp_path / "runs" / "elastic"))
    steps, ids = audit.column("step").to_numpy(), audit.column("sample_id").to_numpy()
    got = {int(s): sorted(ids[steps == s].tolist()) for s in np.unique(steps)}
    assert got == expected_step_ids(dataset, 100, 8)
