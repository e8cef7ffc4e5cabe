"""Goodput in a real run: `checkpoint.interval: auto` (the arithmetic: tests/unit/test_goodput_ledger.py)."""

from __future__ import annotations

import os

import pytest
from mlflow.tracking import MlflowClient

from conftest import make_config, metric_by_step
from raytrain_ft.checkpoint.interval import optimal_interval_s
from raytrain_ft.core.run_folder import list_step_dirs
from raytrain_ft.telemetry.tracking import start_or_resume_run
from raytrain_ft.training.local_session import LocalSession
from raytrain_ft.training.loop import train


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
    loss_logged = {m.step: m.timestamp for m in client.get_metric_history(run_id, "train/loss")}
    plan_logged = {m.step: m.timestamp for m in client.get_metric_history(run_id, "checkpoint_interval_steps")}
    for a, b in zip(saves, saves[1:-1], strict=False):
        committed_at = max(s for s, t in loss_logged.items() if t <= plan_logged[a])
        assert b == max(a + planned["checkpoint_interval_steps"][a], committed_at), (a, b, committed_at)

    saves, data, _ = auto_run(tmp_path / "long", dataset, 10_000.0)
    assert saves == [3, 40]  # a 10,000 h MTBF: the interval outgrows the run
    assert data.metrics["checkpoint_interval_steps"] > 40
