"""Exactly-once data across restarts, world-size changes and epoch boundaries (real Ray, audit on)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.compute as pc
import pytest

from conftest import assert_resumed, assert_same_state, final_state, make_config, metric_by_step
from raytrain_ft.data.audit import read_audit
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import EpochOrder
from raytrain_ft.launch.trainer import RunFailed, run

pytestmark = pytest.mark.usefixtures("ray_local")


def root(cfg) -> str:
    return os.path.join(cfg.run.storage_path, cfg.run.name)


def ids_by_step(cfg) -> dict[int, list[int]]:
    audit = read_audit(root(cfg))
    steps, ids = audit.column("step").to_numpy(), audit.column("sample_id").to_numpy()
    return {int(s): sorted(ids[steps == s].tolist()) for s in np.unique(steps)}


def epoch_prefix(dataset: str, epoch: int, steps: int) -> list[int]:
    order = EpochOrder(dataset, load_manifest(dataset), seed=0, epoch=epoch, global_batch_size=8, micro_batch_size=2)
    return order.step_sample_ids(0, steps).reshape(-1).tolist()


@pytest.fixture(scope="module")
def two_worker_epoch(tmp_path_factory, dataset):
    """Uninterrupted 2-worker run over one whole epoch: 599 samples // 12 = 49 steps; its ids per step and LRs."""
    cfg = make_config(
        tmp_path_factory.mktemp("ws-ref"),
        dataset,
        "run.name=ws",
        "train.max_steps=49",
        "train.global_batch_size=12",
        "data.audit=true",
    )
    run_id = run(cfg)
    return ids_by_step(cfg), metric_by_step(cfg, run_id, "train/lr")


def test_resume_at_another_world_size_keeps_every_step(tmp_path, dataset, two_worker_epoch):
    """One run, three submissions sharing their prefixes: 2 workers until a failure at step 21 (the
    job dies: no restarts allowed), resubmitted with 3 workers from step 20 until a failure at 31,
    resubmitted with 1 worker from step 30 to the end of the epoch."""
    faults = "faults=[{kind: raise, step: 21, rank: 0}, {kind: raise, step: 31, rank: 0}]"
    common = ["run.name=ws", "train.max_steps=49", "train.global_batch_size=12", "data.audit=true", faults]
    with pytest.raises(RunFailed):  # 2 workers, checkpoint at 20 committed, then the job dies
        run(make_config(tmp_path, dataset, *common, "failure.max_failures=0"))
    with pytest.raises(RunFailed):  # 3 workers from 20, checkpoint at 30 committed, then the job dies
        run(make_config(tmp_path, dataset, *common, "failure.max_failures=0", "scaling.num_workers=3"))
    cfg = make_config(tmp_path, dataset, *common, "scaling.num_workers=1")
    run_id = run(cfg)
    attempts = assert_resumed(cfg.tracking.uri, run_id, [0, 20, 30])  # resumed, not re-run from 0
    assert [a["world_size"] for a in attempts] == [2, 3, 1]
    ref_ids, ref_lrs = two_worker_epoch
    steps = ids_by_step(cfg)
    assert steps == ref_ids  # each step's set of ids equals the 2-worker run's
    assert metric_by_step(cfg, run_id, "train/lr") == ref_lrs  # the schedule continues as if nothing changed
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
    ref = make_config(tmp_path / "ref", dataset, "run.name=epochs", *common)
    run(ref)
    faults = "faults=[{kind: kill, step: 75, rank: 0}, {kind: kill, step: 115, rank: 1}]"
    cfg = make_config(tmp_path / "faulty", dataset, "run.name=epochs", *common, faults)
    run_id = run(cfg)
    assert_resumed(cfg.tracking.uri, run_id, [0, 74, 111])  # exactly at the boundary, then 37 steps into epoch 2
    assert read_audit(root(cfg)).equals(read_audit(root(ref)))
    assert_same_state(final_state(cfg, 120), final_state(ref, 120))

    steps = ids_by_step(cfg)
    epoch0 = [i for s in range(1, 75) for i in steps[s]]
    epoch1 = [i for s in range(75, 121) for i in steps[s]]
    assert sorted(epoch0) == sorted(epoch_prefix(dataset, 0, 74))  # all but the 7 tail samples
    assert len(set(epoch0)) == 592 and len(set(range(599)) - set(epoch0)) == 7
    assert sorted(epoch1) == sorted(epoch_prefix(dataset, 1, 46))  # a new permutation
