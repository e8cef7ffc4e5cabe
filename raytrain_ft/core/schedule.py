"""The learning-rate schedule (`train.lr_schedule`), and when a run may be extended past its `max_steps`.

Two schedules, both a linear warmup to `train.lr` over `train.warmup_steps`:

- `cosine` (default): then cosine decay to `lr x min_lr_ratio` at `max_steps` (torch's `LinearLR`
  then `CosineAnnealingLR` in a `SequentialLR`). Every step's LR depends on `max_steps`: a run
  half way down its cosine cannot be lengthened into the cosine it would have had.
- `wsd` (warmup-stable-decay): then constant at `lr` until step `max_steps - decay_steps`, then
  linear decay to `lr x min_lr_ratio` at `max_steps`. Linear warmup, a constant phase and a short
  linear cooldown, as OLMo-core's `olmo_core.optim.scheduler.WSD`; Hägele et al. 2024, "Scaling Laws
  and Compute-Optimal Training Beyond Fixed Training Durations" (arXiv:2405.18392) show a linear
  cooldown over ~20 % of the steps matches cosine's final loss. Until the decay begins no LR depends
  on `max_steps`, so a run extended before then is the run that had planned the longer one.

Step indexing (torch's): the scheduler's `last_epoch` `k` = optimizer steps taken; the LR used by
step `k + 1` (and logged as step `k`'s `lr`) is `lr x factor(k)`.
"""

from __future__ import annotations

import torch

from raytrain_ft.core.config import TrainSection


def lr_schedule(optimizer: torch.optim.Optimizer, t: TrainSection) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler of `t.lr_schedule` for `optimizer` (its param groups' `lr` = `t.lr`).

    Its `state_dict` under `wsd` holds the step count and last LRs only (the factor is a plain
    function, which `LambdaLR.state_dict` does not save): restored into a scheduler built for a
    larger `max_steps` it continues on that scheduler's schedule.
    """
    if t.lr_schedule == "wsd":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, wsd_factor(t))
    warmup = max(1, min(t.warmup_steps, t.max_steps - 1))
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / warmup, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(
                optimizer, T_max=max(1, t.max_steps - warmup), eta_min=t.lr * t.min_lr_ratio
            ),
        ],
        milestones=[warmup],
    )


def wsd_factor(t: TrainSection):
    """`factor(k)` (float, a multiple of `t.lr`) of the warmup-stable-decay schedule after `k` steps:
    `min(1, (k + 1) / warmup_steps)` in the warmup, 1 until `decay_start(t)`, then linear to
    `min_lr_ratio` at `max_steps` (and after it)."""
    warmup, start, decay, floor = max(1, t.warmup_steps), decay_start(t), t.decay_steps, t.min_lr_ratio

    def factor(k: int) -> float:
        if k < start:
            return min(1.0, (k + 1) / warmup)
        return 1.0 - (1.0 - floor) * min(1.0, (k - start) / decay)

    return factor


def decay_start(t: TrainSection) -> int:
    """Steps after which the `wsd` decay begins: `max_steps - decay_steps` (the LR of the step after
    it is still `lr`; every later step's is lower)."""
    return t.max_steps - t.decay_steps


def extension_refusal(saved: dict, max_steps: int, step: int) -> str | None:
    """Why a run planned with the fingerprint `saved` (`raytrain_ft.checkpoint.fingerprint.fingerprint`: its
    `train.lr_schedule`, `train.max_steps`, `train.decay_steps`) cannot continue from its checkpoint
    at `step` towards `max_steps` as if it had planned that from the start; None when it can.

    `wsd` extends while `step <= max_steps_old - decay_steps`: every LR used so far (steps 1 to
    `step + 1`) is the same under both plans. `cosine` never does: its LRs depend on `max_steps` from
    the first step after the warmup.
    """
    planned, schedule = int(saved["train.max_steps"]), saved.get("train.lr_schedule", "cosine")
    if max_steps <= planned:
        return f"--max-steps {max_steps} is not beyond the planned train.max_steps={planned}; extending only lengthens"
    if schedule != "wsd":
        return (
            f"the run uses train.lr_schedule={schedule}: its LR at every step after the warmup depends on "
            f"max_steps (the cosine is {step}/{planned} steps done), so no longer run shares its past; only "
            "train.lr_schedule=wsd runs extend"
        )
    start = planned - saved["train.decay_steps"]
    if step > start:
        return (
            f"the run's wsd decay began after step {start} of {planned} and its checkpoint is at step {step}: "
            "the LR already fell, so no run planned for more steps shares its past"
        )
    return None
