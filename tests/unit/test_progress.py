"""Rank 0's progress line (step / max_steps, loss, tokens/s, an ETA from the recent steps' wall time)
and its throughput per device."""

from __future__ import annotations

import torch

from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.hooks import StepResult
from raytrain_ft.core.recorder import NullRecorder
from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.model.causal_lm import build_model
from raytrain_ft.resilience.guards import SpikeGuard
from raytrain_ft.telemetry.step_metrics import StepMetrics, eta_seconds, progress_line


def test_the_eta_extrapolates_the_mean_wall_time_of_the_recent_steps():
    ended = [100.0, 101.0, 103.0, 106.0]  # 3 steps in 6 s: 2 s each, saves and stalls included
    assert eta_seconds(ended, step_time_s=0.5, remaining=18) == 36.0
    assert eta_seconds([100.0], step_time_s=0.5, remaining=18) == 9.0  # one step seen: its own time


def test_the_progress_line_reads_as_a_sentence():
    line = progress_line(12, 30, 4.123456, 0.5234, 5120.4, 3725.4)
    assert line == "step 12/30 (40%) loss 4.1235 grad_norm 0.523 5120 tokens/s ETA 1:02:05"


class StepRecords(NullRecorder):
    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def record_step(self, step: int, values: dict[str, float], current: dict[str, float], at: float) -> None:
        self.steps.append(values)


def test_throughput_per_device_divides_by_the_devices_that_trained_the_step():
    """Under replica recovery the trainer's world size is 1 (a replica group of one) while the step's
    participants trained it: per-device throughput divides by those (`StepResult.devices`)."""
    cfg = load_config(None, ["train.global_batch_size=8", "train.micro_batch_size=2"])
    model = build_model("tiny", 512, 32)
    scheduler = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(model.parameters(), lr=1.0), lambda s: 1.0)
    recorder = StepRecords()
    metrics = StepMetrics(
        cfg, BatchPlan(8, 2, 1), 32, model, scheduler, DataPosition(), SpikeGuard(10.0, 20, 5), recorder, 1
    )
    for devices in (1, 2, 3):
        metrics.log_step(StepResult(5, 1.0, 1.0, False, None, 0.0, devices=devices), step_time=0.5)
    assert [r["tokens_per_s"] for r in recorder.steps] == [8 * 32 / 0.5] * 3
    assert [r["tokens_per_s_per_device"] for r in recorder.steps] == [8 * 32 / 0.5 / d for d in (1, 2, 3)]
