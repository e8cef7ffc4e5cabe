"""Exactly-once data across restarts, world-size changes and epoch boundaries (audit on), on the
Ray-free session (`tests/local_run.py`: gloo ranks on a `LocalSession`, pyarrow reads). The Ray Data
path across world sizes, with every step's sample ids, is test_elastic.py's.

What exactly-once means is computed from the order alone (`expected_step_ids`: step s of an epoch
takes global batch s of that epoch's permutation) and the LR from the schedule alone
(`conftest.uninterrupted_lrs`), so no uninterrupted reference run is needed here; bitwise weights
after a resume are pinned by test_pretrain.py, test_recovery.py and test_chaos.py."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.compute as pc
import pytest

from conftest import assert_resumed, expected_step_ids, make_config, metric_by_step, uninterrupted_lrs
from local_run import LocalRunFailed, local_run
from raytrain_ft.data.audit import read_audit


def root(cfg) -> str:
    return os.path.join(cfg.run.storage_path, cfg.run.name)


def ids_by_step(cfg) -> dict[int, list[int]]:
    audit = read_audit(root(cfg))
    steps, ids = audit.column("step").to_numpy(), audit.column("sample_id").to_numpy()
    return {int(s): sorted(ids[steps == s].tolist()) for s in np.unique(steps)}


def test_resume_at_another_world_size_keeps_every_step(tmp_path, dataset):
    """One FSDP run, three submissions sharing their prefixes: 2 workers until a failure at step 21
    (the job dies: no restarts allowed), resubmitted with 3 workers from step 20 until a failure at
    31, resubmitted with 1 worker from step 30 to the end of the epoch. FSDP, so each resume also
    reshards the model and AdamW state to the new world size (DCP `DTensor`s)."""
    faults = "faults=[{kind: raise, step: 21, rank: 0}, {kind: raise, step: 31, rank: 0}]"
    common = ["run.name=ws", "train.max_steps=49", "train.global_batch_size=12", "data.audit=true", faults]
    common.append("parallel.strategy=fsdp")
    with pytest.raises(LocalRunFailed, match="InjectedFault"):  # 2 workers, checkpoint at 20 committed, then dies
        local_run(make_config(tmp_path, dataset, *common, "failure.max_failures=0"), world_size=2)
    with pytest.raises(LocalRunFailed, match="InjectedFault"):  # 3 workers from 20, 30 committed, then dies
        local_run(
            make_config(tmp_path, dataset, *common, "failure.max_failures=0", "scaling.num_workers=3"), world_size=3
        )
    cfg = make_config(tmp_path, dataset, *common, "scaling.num_workers=1")
    run_id = local_run(cfg, world_size=1)
    attempts = assert_resumed(cfg.tracking.uri, run_id, [0, 20, 30])  # resumed, not re-run from 0
    assert [a["world_size"] for a in attempts] == [2, 3, 1]
    steps = ids_by_step(cfg)
    assert steps == expected_step_ids(dataset, 49, 12)  # each step's set of ids, whatever the world size
    assert metric_by_step(cfg, run_id, "train/lr") == uninterrupted_lrs(cfg.train)  # as if nothing changed
    consumed = [i for ids in steps.values() for i in ids]
    assert len(consumed) == len(set(consumed)) == 49 * 12  # no repeats, and only the 11 epoch-tail ids dropped
    audit = read_audit(root(cfg))
    for first, last, world_size in ((21, 30, 3), (31, 49, 1)):
        part = audit.filter(
            pc.and_(pc.greater_equal(audit.column("step"), first), pc.less_equal(audit.column("step"), last))
        )
        assert sorted(set(part.column("rank").to_pylist())) == list(range(world_size)), (first, last)


def test_resume_at_epoch_boundary_and_mid_second_epoch(tmp_path, dataset):
    # 599 samples, global batch 8: 74 steps per epoch, 7 samples dropped per epoch.
    common = ["train.max_steps=120", "checkpoint.interval_steps=37", "data.audit=true"]
    faults = "faults=[{kind: kill, step: 75, rank: 0}, {kind: kill, step: 115, rank: 1}]"
    cfg = make_config(tmp_path, dataset, "run.name=epochs", *common, faults)
    run_id = local_run(cfg)
    assert_resumed(cfg.tracking.uri, run_id, [0, 74, 111])  # exactly at the boundary, then 37 steps into epoch 2
    assert metric_by_step(cfg, run_id, "train/lr") == uninterrupted_lrs(cfg.train)

    steps = ids_by_step(cfg)
    assert steps == expected_step_ids(dataset, 120, 8)  # every step, each epoch its own permutation
    epoch0 = [i for s in range(1, 75) for i in steps[s]]
    epoch1 = [i for s in range(75, 121) for i in steps[s]]
    assert len(epoch0) == len(set(epoch0)) == 592 and len(set(range(599)) - set(epoch0)) == 7  # the tail dropped
    assert len(epoch1) == len(set(epoch1)) == 46 * 8 and epoch1[:8] != epoch0[:8]  # a new permutation
