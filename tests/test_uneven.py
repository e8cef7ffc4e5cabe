"""Training at a world size that divides nothing: 3 gloo workers, a global batch of 8 sequences in
4 lanes of 2 (2/3/3 sequences per rank), resumed bitwise after a kill; on the Ray-free session
(`tests/local_run.py`), the killed run against an uninterrupted one."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import (
    assert_resumed,
    assert_same_state,
    final_state,
    make_config,
    metric_by_step,
    run_root,
    uninterrupted_lrs,
)
from local_run import local_run
from raytrain_ft.data.audit import read_audit

THREE = ("scaling.num_workers=3", "train.max_steps=20", "data.audit=true", "checkpoint.interval_steps=5")


@pytest.fixture(scope="module")
def uninterrupted_at_three(tmp_path_factory, dataset):
    cfg = make_config(tmp_path_factory.mktemp("three"), dataset, "run.name=three", *THREE)
    return cfg, local_run(cfg)


def test_a_kill_at_an_uneven_world_size_resumes_bitwise(tmp_path, dataset, uninterrupted_at_three):
    ref_cfg, ref_run = uninterrupted_at_three
    cfg = make_config(tmp_path, dataset, *THREE, "faults=[{kind: kill, step: 13, rank: 2}]")
    run_id = local_run(cfg)
    assert_resumed(cfg.tracking.uri, run_id, [0, 10])
    assert_same_state(final_state(cfg, 20), final_state(ref_cfg, 20))
    assert metric_by_step(cfg, run_id, "train/lr") == uninterrupted_lrs(cfg.train)
    audit = read_audit(run_root(cfg))
    assert audit.equals(read_audit(run_root(ref_cfg)))
    steps, ranks = audit.column("step").to_numpy(), audit.column("rank").to_numpy()
    for step in range(1, 21):  # every step: the whole batch of 8, dealt 2/3/3
        assert np.bincount(ranks[steps == step], minlength=3).tolist() == [2, 3, 3]
    assert len(np.unique(audit.column("sample_id").to_numpy()[steps == 1])) == 8
