"""Rank 0's progress line: step / max_steps, loss, tokens/s and an ETA from the recent steps' wall time."""

from __future__ import annotations

from raytrain_ft.step_metrics import eta_seconds, progress_line


def test_the_eta_extrapolates_the_mean_wall_time_of_the_recent_steps():
    ended = [100.0, 101.0, 103.0, 106.0]  # 3 steps in 6 s: 2 s each, saves and stalls included
    assert eta_seconds(ended, step_time_s=0.5, remaining=18) == 36.0
    assert eta_seconds([100.0], step_time_s=0.5, remaining=18) == 9.0  # one step seen: its own time


def test_the_progress_line_reads_as_a_sentence():
    line = progress_line(12, 30, 4.123456, 0.5234, 5120.4, 3725.4)
    assert line == "step 12/30 (40%) loss 4.1235 grad_norm 0.523 5120 tokens/s ETA 1:02:05"
