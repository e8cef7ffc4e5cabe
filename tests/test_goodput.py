"""Goodput accounting: the wall-time classification, the ledger, and `checkpoint.interval: auto` in a real run."""

from __future__ import annotations

import os

import pytest
from mlflow.tracking import MlflowClient

from conftest import make_config, metric_by_step
from raytrain_ft.checkpoint import list_step_dirs
from raytrain_ft.goodput import GAP_PARTS, GoodputLedger, classify_gap
from raytrain_ft.interval import optimal_interval_s
from raytrain_ft.local_session import LocalSession
from raytrain_ft.loop import train
from raytrain_ft.tracking import start_or_resume_run

# A run created at t=0: first attempt's workers start at 5, restored at 8; a failure at 20 (the
# controller reports it twice, once per failed rank); next attempt starts at 27, restored at 30;
# a rank hangs from 40 and its watchdog fires at 50; that failure is noticed at 52; the third
# attempt starts at 55, restored at 56; classified up to 60.
TIMELINE = [
    {"kind": "attempt_start", "time": 8.0, "init_started_at": 5.0},
    {"kind": "skipped_step", "time": 12.0, "step": 3},
    {"kind": "failure", "time": 20.0},
    {"kind": "failure", "time": 21.0},
    {"kind": "attempt_start", "time": 30.0, "init_started_at": 27.0},
    {"kind": "hang", "time": 50.0, "stalled_s": 10.0},
    {"kind": "failure", "time": 52.0},
    {"kind": "attempt_start", "time": 56.0, "init_started_at": 55.0},
]


def test_a_fresh_run_with_two_failures_and_a_hang_is_classified_second_by_second():
    parts = classify_gap(list(reversed(TIMELINE)), 0.0, 60.0, fresh=True)
    assert parts == {
        "startup": 8.0,
        "lost_work": 12.0 + 10.0 + 2.0 + 4.0,
        "restart_downtime": 7.0 + 3.0,
        "restore": 3.0 + 1.0,
        "hang": 10.0,
        "checkpoint_stall": 0.0,
        "skipped_steps": 0.0,
    }
    assert sum(parts.values()) == 60.0


def test_after_a_checkpoint_only_the_time_since_its_snapshot_is_classified():
    # resumed from a checkpoint whose ledger ends at 45: the first two failures are already in it
    parts = classify_gap(TIMELINE, 45.0, 60.0, fresh=False)
    assert parts["lost_work"] == 5.0 - 5.0 + 2.0 + 4.0 and parts["hang"] == 5.0  # the hang began before 45
    assert parts["restart_downtime"] == 3.0 and parts["restore"] == 1.0 and parts["startup"] == 0.0


def test_a_rollback_turns_the_discarded_steps_into_lost_work_and_its_reload_into_restore():
    events = [{"kind": "rollback", "time": 14.0, "restore_started_at": 12.5}]
    assert classify_gap(events, 10.0, 15.0, fresh=False) == {
        **dict.fromkeys(GAP_PARTS, 0.0),
        "lost_work": 3.5,
        "restore": 1.5,
    }


def test_a_restart_without_a_failure_event_counts_the_unknown_end_of_work_as_lost_work():
    events = [{"kind": "attempt_start", "time": 30.0, "init_started_at": 27.0}]  # e.g. an elastic resize
    assert classify_gap(events, 10.0, 30.0, fresh=False) == {
        **dict.fromkeys(GAP_PARTS, 0.0),
        "lost_work": 17.0,
        "restore": 3.0,
    }


def test_the_ledger_puts_steps_and_stalls_in_their_buckets_and_round_trips():
    ledger = GoodputLedger()
    ledger.start(100.0)
    ledger.add_gap([{"kind": "attempt_start", "time": 104.0, "init_started_at": 103.0}], 104.0, fresh=True)
    ledger.add_step(105.0, stall_s=0.25, skipped=False)
    ledger.add_step(106.0, stall_s=0.0, skipped=True)
    ledger.add("checkpoint_stall", 106.5)
    summary = ledger.summary(110.0)
    assert summary["productive_s"] == 0.75 and summary["goodput"] == 0.75 / 10.0
    assert summary["badput_startup_s"] == 4.0 and summary["badput_skipped_steps_s"] == 1.0
    assert summary["badput_checkpoint_stall_s"] == 0.75 and summary["unaccounted_s"] == pytest.approx(3.5)
    copy = GoodputLedger()
    copy.load_state_dict(ledger.state_dict())
    assert copy.summary(110.0) == summary


def auto_run(tmp_path, dataset, mtbf_hours: float) -> tuple[list[int], dict, str]:
    """A one-rank run (no Ray) with `checkpoint.interval: auto`; returns its save steps, metrics, run id."""
    cfg = make_config(
        tmp_path,
        dataset,
        "train.max_steps=40",
        "train.global_batch_size=4",
        "checkpoint.interval=auto",
        "checkpoint.interval_steps=5",
        f"failure.mtbf_hours_per_gpu={mtbf_hours}",
        "faults=[{kind: slow, step: 1, steps: 40, seconds: 0.05}]",  # a steady step time
    )
    root = os.path.join(cfg.run.storage_path, cfg.run.name)
    run_id = start_or_resume_run(cfg.tracking.uri, "auto", root, cfg.run.name, {})
    train(cfg, LocalSession(root, cfg.data.path, cfg.train.seed, cfg.tracking.uri, run_id))
    return sorted(list_step_dirs(root)), MlflowClient(cfg.tracking.uri).get_run(run_id).data, run_id


def test_auto_interval_follows_daly_for_the_measured_cost_and_the_configured_mtbf(tmp_path, dataset, process_group):
    mtbf_hours = 0.001  # 3.6 s for the one worker: a save every few steps
    saves, data, run_id = auto_run(tmp_path / "short", dataset, mtbf_hours)
    assert data.tags["mtbf_source"] == "configured" and data.metrics["mtbf_s"] == pytest.approx(3.6)
    cfg = make_config(tmp_path / "short", dataset)
    planned = {k: metric_by_step(cfg, run_id, k) for k in ("checkpoint_interval_steps", "checkpoint_interval_s")}
    inputs = {
        k: metric_by_step(cfg, run_id, k) for k in ("checkpoint_cost_s", "checkpoint_save_s", "median_step_time_s")
    }
    assert len(planned["checkpoint_interval_steps"]) >= 3
    for step, steps in planned["checkpoint_interval_steps"].items():
        cost, save, step_time = (inputs[k][step] for k in inputs)
        interval = max(optimal_interval_s(max(cost, 1e-3), 3.6), save)
        assert planned["checkpoint_interval_s"][step] == pytest.approx(interval)
        assert steps == max(1, round(interval / step_time)) and interval >= save
    # the saves follow the plan, exactly: 3 steps (the cost measured early); then the save at `a`
    # commits at step `c` (the last step whose loss was logged before its plan) and sets the plan
    # `p`, and the next save comes at a + p, or at c if the write outlasted the plan
    assert saves[0] == 3 and saves[-1] == 40
    client = MlflowClient(cfg.tracking.uri)
    loss_logged = {m.step: m.timestamp for m in client.get_metric_history(run_id, "loss")}
    plan_logged = {m.step: m.timestamp for m in client.get_metric_history(run_id, "checkpoint_interval_steps")}
    for a, b in zip(saves, saves[1:-1], strict=False):
        committed_at = max(s for s, t in loss_logged.items() if t <= plan_logged[a])
        assert b == max(a + planned["checkpoint_interval_steps"][a], committed_at), (a, b, committed_at)

    saves, data, _ = auto_run(tmp_path / "long", dataset, 10_000.0)
    assert saves == [3, 40]  # a 10,000 h MTBF: the interval outgrows the run
    assert data.metrics["checkpoint_interval_steps"] > 40
