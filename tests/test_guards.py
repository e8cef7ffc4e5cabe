"""Guards on a real 2-worker run: spike/NaN skips agreed by all ranks, rollback, rank check, replica fingerprints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import assert_resumed, assert_same_state, events, final_state, make_config
from raytrain_ft.checkpoint import load_model_state_dict, step_path
from raytrain_ft.data.audit import read_audit
from raytrain_ft.launch.trainer import run

pytestmark = pytest.mark.usefixtures("ray_local")


def root(cfg) -> str:
    return os.path.join(cfg.run.storage_path, cfg.run.name)


def weights(cfg, step: int) -> dict[str, torch.Tensor]:
    return load_model_state_dict(step_path(root(cfg), step))


def test_one_rank_spikes_are_skipped_everywhere_and_history_survives_restart(tmp_path, dataset):
    # A 20-step history. Spike on rank 1 only at 30 (history warm); kill at 40 -> resume from 35; spike on
    # rank 0 at 45: only 10 steps after the restart, so it is judged only if the history was restored.
    faults = (
        "faults=[{kind: spike, step: 30, rank: 1}, {kind: kill, step: 40, rank: 1}, {kind: spike, step: 45, rank: 0}]"
    )
    history = ["guards.spike.window=20", "guards.spike.warmup=20"]
    cfg = make_config(tmp_path, dataset, "train.max_steps=50", "guards.fingerprint.interval_steps=5", *history, faults)
    run_id = run(cfg)
    assert_resumed(cfg.tracking.uri, run_id, [0, 35])
    skips = events(cfg.tracking.uri, run_id, "skipped_step")
    assert [e["step"] for e in skips] == [30, 45]  # the 45 skip needs the 20-step history from the checkpoint
    assert all(e["grad_norm"] > 10 * e["median"] for e in skips)
    assert MlflowClient(cfg.tracking.uri).get_run(run_id).data.metrics["skipped_steps"] == 2
    assert events(cfg.tracking.uri, run_id, "replica_mismatch") == []  # replicas identical, checked every 5 steps
    assert all(torch.isfinite(w).all() for w in weights(cfg, 50).values())


# every guard at a short interval, `on_alert: restart`: the clean run and the bit-flip run share it
GUARDED_60 = [
    "run.name=g",
    "train.max_steps=60",
    "checkpoint.interval_steps=10",
    "guards.fingerprint.interval_steps=5",
    "guards.rank_check.interval_steps=1",
    "guards.on_alert=restart",
]


@pytest.fixture(scope="module")
def clean_60(tmp_path_factory, dataset):
    """A clean 60-step run with every guard at a short interval and `on_alert: restart`."""
    cfg = make_config(
        tmp_path_factory.mktemp("clean"),
        dataset,
        *GUARDED_60,
    )
    run_id = run(cfg)
    return cfg, run_id


def test_clean_run_raises_no_alert(clean_60):
    cfg, run_id = clean_60
    assert (
        events(cfg.tracking.uri, run_id, "rank_spread") == []
        and events(cfg.tracking.uri, run_id, "replica_mismatch") == []
    )
    assert "restarts" not in MlflowClient(cfg.tracking.uri).get_run(run_id).data.metrics


def test_bitflip_is_detected_and_the_run_restarts_from_a_clean_checkpoint(tmp_path, dataset, clean_60):
    clean_cfg, _ = clean_60
    cfg = make_config(
        tmp_path,
        dataset,
        *GUARDED_60,
        "faults=[{kind: bitflip, step: 42, rank: 1}]",
    )
    run_id = run(cfg)
    assert [e["step"] for e in events(cfg.tracking.uri, run_id, "replica_mismatch")] == [45]
    assert_resumed(cfg.tracking.uri, run_id, [0, 40])
    assert_same_state(final_state(cfg, 60), final_state(clean_cfg, 60))


def test_rank_check_flags_a_tenfold_loss_and_nan_is_skipped(tmp_path, dataset):
    faults = "faults=[{kind: spike, step: 10, rank: 1, factor: 10.0}, {kind: nan, step: 15, rank: 0}]"
    cfg = make_config(tmp_path, dataset, "train.max_steps=20", "guards.rank_check.interval_steps=1", faults)
    run_id = run(cfg)
    alerts = events(cfg.tracking.uri, run_id, "rank_spread")
    assert [a["step"] for a in alerts] == [10]
    loss_by_rank = [row[0] for row in alerts[0]["loss_grad_norm_by_rank"]]
    assert loss_by_rank[1] > 5 * loss_by_rank[0]
    assert [e["step"] for e in events(cfg.tracking.uri, run_id, "skipped_step")] == [
        15
    ]  # NaN on rank 0, skipped on both
    assert all(torch.isfinite(w).all() for w in weights(cfg, 20).values())


def test_persistent_spikes_roll_back_and_skip_the_data_window(tmp_path, dataset):
    faults = "faults=[{kind: spike, step: 120, rank: -1, steps: 5}]"
    cfg = make_config(tmp_path, dataset, "train.max_steps=130", "data.audit=true", faults)
    run_id = run(cfg)
    rollbacks = events(cfg.tracking.uri, run_id, "rollback")
    assert len(rollbacks) == 1
    assert rollbacks[0]["at_step"] == 124 and rollbacks[0]["to_step"] == 115  # last checkpoint before step 120
    skipped = set(rollbacks[0]["skipped_sample_ids"])
    assert len(skipped) == 10 * 8
    audit = read_audit(root(cfg))
    steps, ids = audit.column("step").to_numpy(), audit.column("sample_id").to_numpy()
    assert sorted(set(steps.tolist())) == list(range(1, 131))
    epoch_1_after = set(ids[(steps > 115) & (steps <= 138)].tolist())  # epoch 1 runs to step 74 + (592 - 80) / 8
    assert skipped.isdisjoint(epoch_1_after)
    assert len(ids[steps > 74]) == len(set(ids[steps > 74].tolist()))  # still exactly once within epoch 1
    record = json.loads(json.dumps(rollbacks[0]))
    assert record["skipped_steps"] == 10
