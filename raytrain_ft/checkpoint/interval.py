"""Checkpoint interval: how often to checkpoint, given what a checkpoint costs and how often the cluster fails.

All times are in seconds unless a name says otherwise. Failures are modelled as a Poisson process
(exponential times between failures) with mean `mtbf_s`, the cluster's mean time between failures.

* `young_interval_s`: Young's first-order optimum `sqrt(2 * C * M)` (J. W. Young, "A first order
  approximation to the optimum checkpoint interval", Communications of the ACM 17(9), 1974).
* `daly_interval_s`: Daly's higher-order optimum (J. T. Daly, "A higher order estimate of the
  optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), 2006).
  It is slightly shorter than Young's and converges to it as `C / M -> 0`.
* `optimal_interval_s` is Daly's estimate: as good as Young's when checkpoints are cheap, better when not.
* `expected_waste_fraction`: the first-order waste model both estimates minimise.
* `simulate_waste`: an event simulation of a whole run, to check the models.

The interval `tau` here is the *compute* time between two checkpoints; the checkpoint cost `C`
comes on top (one period of wall time is `tau + C`). The restart time `R` does not move the optimum
(it multiplies the expected time of every period by the same factor `exp(R / M)`), only the waste.
"""

from __future__ import annotations

import math
import time
from numbers import Real
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from raytrain_ft.core.config import Config

SECONDS_PER_HOUR = 3600.0


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, Real) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _check_non_negative(**values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, Real) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")


def cluster_mtbf_s(mtbf_hours_per_gpu: float, num_gpus: int) -> float:
    """Cluster MTBF in seconds: the per-GPU MTBF (hours) divided by the number of GPUs.

    With independent exponential failures the cluster fails at the sum of the per-GPU rates, so
    10,000 h per GPU on 1,000 GPUs is one failure every 10 h (36,000 s).
    """
    _check_positive(mtbf_hours_per_gpu=mtbf_hours_per_gpu, num_gpus=num_gpus)
    return mtbf_hours_per_gpu * SECONDS_PER_HOUR / num_gpus


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's optimum compute time between checkpoints, seconds: `sqrt(2 * cost_s * mtbf_s)`.

    Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9).
    Accurate when `cost_s << mtbf_s`. 5 min checkpoints at a 10 h MTBF: 4,648 s = 77.5 min.
    """
    _check_positive(cost_s=cost_s, mtbf_s=mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints, seconds.

    Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
    FGCS 22(3): with `x = cost_s / (2 * mtbf_s)`,
    `tau = sqrt(2 * C * M) * (1 + sqrt(x) / 3 + x / 9) - C` for `C < 2M`, else `tau = M`.
    `tau` is compute time only (the checkpoint's `C` seconds come on top). Always below Young's
    interval for `C < 2M`, and `daly / young -> 1` as `C / M -> 0`.
    """
    _check_positive(cost_s=cost_s, mtbf_s=mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return float(mtbf_s)
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def optimal_interval_s(cost_s: float, mtbf_s: float) -> float:
    """The interval to use, seconds of compute between checkpoints: Daly's estimate.

    Daly's estimate reduces to Young's for cheap checkpoints (`C / M -> 0`) and stays close to the
    true optimum of the exponential-failure model when they are not, so there is no case where
    Young's is the better choice. `young_interval_s` is kept as the textbook formula (docs/restart-recovery.md).
    """
    return daly_interval_s(cost_s, mtbf_s)


def expected_waste_fraction(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """First-order expected fraction of wall time that is not useful compute, in [0, 1].

    The first-order model behind Young's and Daly's estimates: `cost_s / interval_s` (checkpoint
    overhead) plus `(interval_s / 2 + restart_s) / mtbf_s` (per failure, on average half an
    interval of lost work to redo, plus the restart). Valid when `interval_s + cost_s << mtbf_s`;
    it slightly overestimates the waste otherwise. Clamped to [0, 1].
    """
    _check_positive(interval_s=interval_s, cost_s=cost_s, mtbf_s=mtbf_s)
    _check_non_negative(restart_s=restart_s)
    waste = cost_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s
    return min(1.0, max(0.0, waste))


def simulate_waste(
    interval_s: float,
    cost_s: float,
    mtbf_s: float,
    work_s: float,
    restart_s: float = 0.0,
    seed: int = 0,
) -> float:
    """Simulated fraction of wall time that is not useful compute, `1 - work_s / wall_s`.

    An event simulation of one run that needs `work_s` seconds of useful compute. It computes in
    periods of `interval_s` (the last one shorter if `work_s` is not a multiple), each followed by a
    checkpoint of `cost_s` seconds (the last one too: the final state is saved). Failures arrive
    with exponential times of mean `mtbf_s` (`numpy.random.default_rng(seed)`); the clock restarts
    after each recovery. A failure during compute or during the checkpoint loses everything since
    the last completed checkpoint; then `restart_s` seconds are spent and the period starts again.
    Failures during the restart are not modelled (by memorylessness that only shifts the next one).
    The same `seed` gives the same failure stream for every interval (common random numbers), so
    comparisons between intervals are much less noisy than the waste values themselves.
    """
    _check_positive(interval_s=interval_s, cost_s=cost_s, mtbf_s=mtbf_s, work_s=work_s)
    _check_non_negative(restart_s=restart_s)
    rng = np.random.default_rng(seed)
    gaps: list[float] = []

    def next_failure_in() -> float:
        if not gaps:
            gaps.extend(rng.exponential(mtbf_s, size=1024).tolist()[::-1])
        return gaps.pop()

    full_periods, rest = divmod(work_s, interval_s)
    computes = [interval_s] * int(full_periods) + ([rest] if rest > 1e-9 * interval_s else [])
    wall = 0.0
    until_failure = next_failure_in()
    for compute in computes:
        period = compute + cost_s
        while until_failure < period:  # fails before this period's checkpoint completes: redo it
            wall += until_failure + restart_s
            until_failure = next_failure_in()
        wall += period
        until_failure -= period
    return 1.0 - work_s / wall


def interval_steps(interval_s: float, step_time_s: float, min_steps: int = 1) -> int:
    """`interval_s` seconds of compute as a number of training steps of `step_time_s` seconds.

    Rounded to the nearest step, and at least `min_steps` (for `checkpoint.interval_steps`).
    """
    _check_positive(interval_s=interval_s, step_time_s=step_time_s)
    if min_steps < 1:
        raise ValueError(f"min_steps must be at least 1, got {min_steps!r}")
    return max(int(min_steps), math.floor(interval_s / step_time_s + 0.5))


MIN_OBSERVED_FAILURES = 3
MIN_COST_S = 1e-3  # a measured stall of ~0 s would make the interval ~0


def planning_mtbf_s(
    mtbf_hours_per_gpu: float, num_gpus: int, failure_times: list[float], run_start: float, now: float
) -> tuple[float, str]:
    """The cluster MTBF (seconds) to plan checkpoints with, and where it came from.

    After `MIN_OBSERVED_FAILURES` (3) or more failures of this run: observed, the run's wall time
    so far (`now - run_start`, unix seconds) divided by its failures. Before that: configured,
    `cluster_mtbf_s(mtbf_hours_per_gpu, num_gpus)` (GPUs, or workers on CPU).
    """
    if len(failure_times) >= MIN_OBSERVED_FAILURES and now > run_start:
        return (now - run_start) / len(failure_times), "observed"
    return cluster_mtbf_s(mtbf_hours_per_gpu, num_gpus), "configured"


FIRST_SAVE_STEPS = 3  # auto mode: enough steps for a median step time (the watchdog's), few enough to lose little


class CheckpointSchedule:
    """When to start a checkpoint: every `interval_steps`, or Daly's interval (`checkpoint.interval: auto`).

    Fixed: at every multiple of `interval_steps`. Auto (`mtbf_s` given): the first save of an attempt
    comes `FIRST_SAVE_STEPS` steps after its start (or `interval_steps`, if fewer), to measure the
    checkpoint cost early instead of training an interval with an unknown cost (and losing it all to
    a failure before the first save); then `update` sets the interval to
    `max(optimal_interval_s(cost, mtbf_s), save duration)` seconds of compute (Daly 2006; never
    shorter than one save, so writes do not queue up), converted to steps at the current step time.
    """

    def __init__(self, interval_steps: int, mtbf_s: float | None = None, last_save_step: int = 0, prefix: str = ""):
        self.steps, self.mtbf_s, self.last_save_step = interval_steps, mtbf_s, last_save_step
        self.prefix = prefix  # of the logged names: "memory_" for the memory tier's schedule
        if self.auto:
            self.steps = min(interval_steps, FIRST_SAVE_STEPS)

    @property
    def auto(self) -> bool:
        return self.mtbf_s is not None

    def due(self, step: int) -> bool:
        if self.auto:
            return step - self.last_save_step >= self.steps
        return step % self.steps == 0

    def saved(self, step: int) -> None:
        self.last_save_step = step

    def update(self, cost_s: float, save_s: float, step_time_s: float) -> dict[str, float]:
        """Recompute the auto interval from the last save's cost (training stall, seconds), its
        duration (start to commit, seconds) and the step time (seconds); returns what to log."""
        if self.mtbf_s is None or step_time_s <= 0:
            return {}
        interval = max(optimal_interval_s(max(cost_s, MIN_COST_S), self.mtbf_s), save_s)
        self.steps = interval_steps(interval, step_time_s)
        p = self.prefix
        return {
            f"{p}checkpoint_interval_steps": self.steps,
            f"{p}checkpoint_interval_s": interval,
            f"{p}checkpoint_cost_s": cost_s,
            f"{p}checkpoint_save_s": save_s,
            "median_step_time_s": step_time_s,
            "mtbf_s": self.mtbf_s,
        }


def agreed_schedule(
    interval_steps: int, mtbf_s: float, last_save_step: int, group: dist.ProcessGroup, prefix: str = ""
) -> CheckpointSchedule:
    """The auto schedule (`checkpoint.interval: auto`) at the MTBF (seconds) rank 0 planned with:
    broadcast over `group` (a collective), since the ranks' clocks differ and their plans must not."""
    agreed = torch.tensor([mtbf_s], dtype=torch.float64)
    dist.broadcast(agreed, src=0, group=group)
    return CheckpointSchedule(interval_steps, agreed.item(), last_save_step=last_save_step, prefix=prefix)


def auto_schedule(
    cfg: Config,
    world_size: int,
    failure_times: list[float],
    run_start: float,
    step: int,
    group: dist.ProcessGroup,
    memory: bool = False,
) -> tuple[CheckpointSchedule, str]:
    """`checkpoint.interval: auto` at an attempt's start (`step`): Daly's interval at the MTBF
    (`planning_mtbf_s` from the run's failures, unix seconds, since `run_start`) rank 0 chose
    (`agreed_schedule`: broadcast, the ranks' clocks differ, their plans must not), and the MTBF's
    source (`planning_mtbf_s`). `memory`: the memory tier's (`checkpoint.memory.interval: auto`), its
    first save after `checkpoint.memory.interval_steps` at most and its figures logged as `memory_*`."""
    f = cfg.failure
    first = cfg.checkpoint.memory.interval_steps if memory else cfg.checkpoint.interval_steps
    planned, source = planning_mtbf_s(f.mtbf_hours_per_gpu, world_size, failure_times, run_start, time.time())
    return agreed_schedule(first, planned, step, group, "memory_" if memory else ""), source


class SaveCosts(Protocol):
    """What a save cost: a `Checkpointer`'s or a `MemoryTier`'s last one, seconds."""

    @property
    def last_cost_s(self) -> float: ...

    @property
    def last_duration_s(self) -> float: ...


def agreed_update(
    schedule: CheckpointSchedule, checkpointer: SaveCosts, step_time_s: float, group: dist.ProcessGroup
) -> dict[str, float]:
    """After a commit: `schedule.update` with the slowest rank's figures, the checkpointer's last
    save (`last_cost_s`, `last_duration_s`) and `step_time_s` (an all-reduce MAX over `group`, a
    collective: every rank plans the same interval); returns what to log. A fixed interval
    (`schedule.auto` false on every rank) returns {} at once, without the collective."""
    if not schedule.auto:
        return {}
    measured = torch.tensor([checkpointer.last_cost_s, checkpointer.last_duration_s, step_time_s])
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=group)
    return schedule.update(*measured.tolist())
