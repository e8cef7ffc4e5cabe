"""Step hooks: the per-step side work of the training loop, kept out of `Trainer.step`.

`Trainer.step` is the training algorithm; around it, every rank calls its `StepHooks` at four
points of each optimizer step, each hook in the order it was given:

* `before_step(step)`: before the batch is read (fault injection: `raise`, `kill`; step timer);
* `after_batch(step, micro_batches)`: this rank's micro-batches are read, nothing computed yet
  (data audit: a collective; the recovery phase `first_batch_at`);
* `after_optimizer_step(result)`: the update is applied or skipped, the scheduler stepped and the
  data position advanced (fault injection: `bitflip`, `hang`, `slow`; goodput per step; step
  metrics and MFU; skip events);
* `after_step(step)`: the step is over, its save started or its rollback done (the progress beat).
  Not called when the step raised.

A hook lives with its concept (`faults.FaultInjector`, `data.audit.DataAudit`,
`goodput.StepAccount`, `step_metrics.StepMetrics`, `watchdog.StepBeat`), never in the loop.
Hooks observe; they do not change what the step computes. The exception is fault injection that
must alter the algorithm's own values: the loss multiplier of `nan`/`spike` faults
(`FaultInjector.loss_factor`) and the slowed and killed checkpoint writes (`writer_for`,
`after_save_started`) stay explicit calls in the loop, where a reader sees what they change; the
`bitflip` fault corrupts a parameter in `after_optimizer_step`, as a hardware fault would, behind
the loop's back. Hooks that call collectives run on every rank in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step produced (the same on every rank).

    `loss`: the global mean loss (float); `grad_norm`: the global L2
    norm before clipping; `skipped`: the spike guard skipped the update; `median`: the guard's
    median grad norm (None during its warm-up); `stall_s`: seconds this step was blocked on a
    checkpoint (snapshot copy, or the previous write); `validation`: `val_loss` and
    `val_perplexity` at a validated step (`raytrain_ft.training.validation`), else empty; `validation_s`: its
    seconds (0 without one); `recovery_s`: seconds of the step lost to a peer replica's failure
    (`StepMembers.recovering_s`: under replica recovery, the quorum's wait for the lighthouse to
    drop a dead replica; else 0); `devices`: the devices that trained the step, the split's world
    size (under replica recovery the step's participating replicas, one device each), what
    throughput per device and MFU divide by; `compute_s_per_seq`: every member's compute seconds per
    sequence of the step, waits in collectives excluded, in the split's rank order (`raytrain_ft.resilience.straggler`);
    `shares`: every member's sequences of the step, in the same order.
    """

    step: int
    loss: float
    grad_norm: float
    skipped: bool
    median: float | None
    stall_s: float
    validation: dict[str, float] = field(default_factory=dict)
    validation_s: float = 0.0
    recovery_s: float = 0.0
    devices: int = 1
    compute_s_per_seq: tuple[float, ...] = ()
    shares: tuple[int, ...] = ()


class StepHook:
    """Base class: override the points a hook needs; the others do nothing."""

    def before_step(self, step: int) -> None:
        pass

    def after_batch(self, step: int, micro_batches: list[dict]) -> None:
        pass

    def after_optimizer_step(self, result: StepResult) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass


class StepHooks(StepHook):
    """Several hooks called in order, at every point."""

    def __init__(self, hooks: list[StepHook]):
        self.hooks = hooks

    def before_step(self, step: int) -> None:
        for h in self.hooks:
            h.before_step(step)

    def after_batch(self, step: int, micro_batches: list[dict]) -> None:
        for h in self.hooks:
            h.after_batch(step, micro_batches)

    def after_optimizer_step(self, result: StepResult) -> None:
        for h in self.hooks:
            h.after_optimizer_step(result)

    def after_step(self, step: int) -> None:
        for h in self.hooks:
            h.after_step(step)
