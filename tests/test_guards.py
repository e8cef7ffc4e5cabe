"""Guards on real 2-rank runs: spike/NaN skips agreed by all ranks, rollback, rank check, replica fingerprints.

The faulted runs are Ray-free (`local_run`: gloo ranks on a `LocalSession`, restarted from the last
commit after a failed attempt); the clean run is the session's `reference`, also Ray-free."""

from __future__ import annotations

import json
import os

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import GUARDED, assert_resumed, assert_same_state, events, final_state, make_config
from local_run import local_run
from raytrain_ft.checkpoint.reader import load_model_state_dict
from raytrain_ft.core.run_folder import complete_steps, step_path
from raytrain_ft.data.audit import read_audit
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import window_sample_ids
from raytrain_ft.data.position import BatchPlan, DataPosition


def root(cfg) -> str:
    return os.path.join(cfg.run.storage_path, cfg.run.name)


def weights(cfg, step: int) -> dict[str, torch.Tensor]:
    return load_model_state_dict(step_path(root(cfg), step))


TINY_PARAMETERS = 21  # tensors in the tiny model's state dict (embedding, 2 layers x 9, norm, head)


def assert_all_finite(cfg, step: int) -> None:
    """Every weight tensor of the checkpoint at `step` is present and finite (an empty dict fails)."""
    w = weights(cfg, step)
    assert len(w) == TINY_PARAMETERS, sorted(w)
    for name, t in w.items():
        assert torch.isfinite(t).all(), name


# One run for the spike guard and the rank check: a 20-step history, every rank checked every step.
# Rank 1's loss x10 at step 10 (before the guard's warmup: not a skip, a rank_spread alert); a NaN on
# rank 0 at 15 (skipped everywhere); a spike on rank 1 at 30 (history warm); a kill at 40 -> resume from
# 35; a spike on rank 0 at 45: only 10 steps after the restart, so it is judged only if the history was
# restored.
SPIKES_AND_RANK_CHECK = [
    "train.max_steps=50",
    "guards.fingerprint.interval_steps=5",
    "guards.spike.window=20",
    "guards.spike.warmup=20",
    "guards.rank_check.interval_steps=1",
    "faults=[{kind: spike, step: 10, rank: 1, factor: 10.0}, {kind: nan, step: 15, rank: 0},"
    " {kind: spike, step: 30, rank: 1}, {kind: kill, step: 40, rank: 1}, {kind: spike, step: 45, rank: 0}]",
]


@pytest.fixture(scope="module")
def spikes_run(tmp_path_factory, dataset):
    cfg = make_config(tmp_path_factory.mktemp("spikes"), dataset, *SPIKES_AND_RANK_CHECK)
    return cfg, local_run(cfg)


def test_one_rank_spikes_are_skipped_everywhere_and_history_survives_restart(spikes_run):
    cfg, run_id = spikes_run
    assert_resumed(cfg.tracking.uri, run_id, [0, 35])
    skips = events(cfg.tracking.uri, run_id, "skipped_step")
    assert [e["step"] for e in skips] == [15, 30, 45]  # the 45 skip needs the 20-step history from the checkpoint
    spikes = [e for e in skips if e["step"] in (30, 45)]
    assert len(spikes) == 2 and all(e["grad_norm"] > 10 * e["median"] for e in spikes)
    assert MlflowClient(cfg.tracking.uri).get_run(run_id).data.metrics["skipped_steps"] == 3
    assert events(cfg.tracking.uri, run_id, "replica_mismatch") == []  # replicas identical, checked every 5 steps
    assert_all_finite(cfg, 50)


def test_rank_check_flags_a_tenfold_loss_and_nan_is_skipped(spikes_run):
    cfg, run_id = spikes_run
    alerts = events(cfg.tracking.uri, run_id, "rank_spread")
    assert [a["step"] for a in alerts] == [10, 30, 45]  # the x10 loss, then the two x1000 spikes; not the NaN
    loss_by_rank = [row[0] for row in alerts[0]["loss_grad_norm_by_rank"]]
    assert loss_by_rank[1] > 5 * loss_by_rank[0]
    assert 15 in [e["step"] for e in events(cfg.tracking.uri, run_id, "skipped_step")]  # NaN on rank 0, skipped on both
    assert_all_finite(cfg, 50)  # the NaN step changed no weight


def test_clean_run_raises_no_alert(reference):
    """The reference run carries every guard at a short interval (conftest `GUARDED`)."""
    cfg, run_id, _ = reference
    assert cfg.guards.rank_check.interval_steps == 1 and cfg.guards.on_alert == "restart"
    assert (
        events(cfg.tracking.uri, run_id, "rank_spread") == []
        and events(cfg.tracking.uri, run_id, "replica_mismatch") == []
    )
    assert_resumed(cfg.tracking.uri, run_id, [0])  # one attempt: no alert restarted it


def test_bitflip_is_detected_and_the_run_restarts_from_a_clean_checkpoint(tmp_path, dataset, reference):
    """Flip at 15 (a save step): only the replica check before that save can see it (the next
    interval check is at 21), so no checkpoint holds diverged replicas; flip at 26: the interval
    check at 28, before the save of 30."""
    cfg = make_config(
        tmp_path,
        dataset,
        "train.max_steps=30",
        *GUARDED,
        "faults=[{kind: bitflip, step: 15, rank: 1}, {kind: bitflip, step: 26, rank: 1}]",
    )
    run_id = local_run(cfg)
    assert [e["step"] for e in events(cfg.tracking.uri, run_id, "replica_mismatch")] == [15, 28]
    assert_resumed(cfg.tracking.uri, run_id, [0, 10, 25])
    assert_same_state(final_state(cfg, 30), reference[2])


def test_under_warn_a_diverged_fingerprint_withholds_every_later_save_the_final_one_included(tmp_path, dataset):
    """`on_alert: warn` (the default): the flip at 15 is logged at the fingerprint before the save of 15
    and again before the final save at 20; neither is written, so no checkpoint holds diverged
    replicas and the run ends on the last consistent one (10)."""
    cfg = make_config(
        tmp_path,
        dataset,
        "train.max_steps=20",
        "guards.fingerprint.interval_steps=7",
        "guards.on_alert=warn",
        "faults=[{kind: bitflip, step: 15, rank: 1}]",
    )
    run_id = local_run(cfg)
    assert [e["step"] for e in events(cfg.tracking.uri, run_id, "replica_mismatch")] == [15, 20]
    assert complete_steps(root(cfg)) == [5, 10]
    assert_resumed(cfg.tracking.uri, run_id, [0])  # warn: no restart


def test_the_save_before_an_excluded_rank_leaves_is_fingerprinted_and_withheld_when_diverged(tmp_path, dataset):
    """The save of the step after which a straggler leaves (restart recovery: the attempt ends at that
    step) checks the fingerprint like every other save: rank 0's weights flipped at step 2, under
    `warn`, the step is never written; the fingerprint ran there and nowhere else (interval 100)."""
    cfg = make_config(
        tmp_path,
        dataset,
        "scaling.num_workers=[1, 2]",  # one member may leave
        "train.max_steps=40",
        "checkpoint.interval_steps=100",
        "guards.fingerprint.interval_steps=100",
        "guards.on_alert=warn",
        "straggler.action=exclude",
        "straggler.exclude_after_steps=2",
        "faults=[{kind: bitflip, step: 2, rank: 0}, {kind: slow, rank: 1, factor: 3.0, step: 1, steps: 100}]",
    )
    run_id = local_run(cfg)
    [excluded] = [e for e in events(cfg.tracking.uri, run_id, "straggler") if e["action"] == "exclude"]
    assert excluded["rank"] == 1
    assert [e["step"] for e in events(cfg.tracking.uri, run_id, "replica_mismatch")] == [excluded["step"]]
    assert complete_steps(root(cfg)) == []  # the diverged step was not saved
    assert_resumed(cfg.tracking.uri, run_id, [0])  # one attempt, ended at the exclusion (no driver restarts it)


def test_persistent_spikes_roll_back_and_skip_the_data_window(tmp_path, dataset):
    faults = "faults=[{kind: spike, step: 120, rank: -1, steps: 5}]"
    cfg = make_config(tmp_path, dataset, "train.max_steps=130", "data.audit=true", faults)
    run_id = local_run(cfg)
    rollbacks = events(cfg.tracking.uri, run_id, "rollback")
    assert len(rollbacks) == 1
    assert rollbacks[0]["at_step"] == 124 and rollbacks[0]["to_step"] == 115  # last checkpoint before step 120
    skipped = set(rollbacks[0]["skipped_sample_ids"])
    assert len(skipped) == 10 * 8
    audit = read_audit(root(cfg))
    steps, ids = audit.column("step").to_numpy(), audit.column("sample_id").to_numpy()
    assert sorted(set(steps.tolist())) == list(range(1, 131))
    # tied to the data order: the skipped ids are the global batches of steps 116-125 of the uninterrupted
    # order (from step 115's position, epoch 1), and after the rollback step s trains the order's batch s + 10
    at_115 = DataPosition(1, (115 - 74) * 8)
    order = window_sample_ids(dataset, load_manifest(dataset), cfg.train.seed, at_115, BatchPlan(8, 2, 2), 25)
    assert rollbacks[0]["skipped_sample_ids"] == order[:80]
    for s in range(116, 131):
        k = s - 116 + 10
        assert sorted(ids[steps == s].tolist()) == sorted(order[k * 8 : (k + 1) * 8]), f"step {s}"
    epoch_1_after = set(ids[(steps > 115) & (steps <= 138)].tolist())  # epoch 1 runs to step 74 + (592 - 80) / 8
    assert skipped.isdisjoint(epoch_1_after)
    assert len(ids[steps > 74]) == len(set(ids[steps > 74].tolist()))  # still exactly once within epoch 1
    record = json.loads(json.dumps(rollbacks[0]))
    assert record["skipped_steps"] == 10
    # one value per step on the kept timeline; the rolled-back steps' first values are under train_discarded/
    client = MlflowClient(cfg.tracking.uri)
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(1, 131))
    assert sorted(m.step for m in client.get_metric_history(run_id, "train_discarded/loss")) == list(range(116, 125))
