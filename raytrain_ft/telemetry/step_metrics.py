"""What every optimizer step reports: loss, learning rate, grad norm, throughput, MFU, skips.

`StepMetrics` is a step hook (`raytrain_ft.core.hooks`) on every rank; each records through its
`Recorder` (`raytrain_ft.core.recorder`: rank 0's records, the others' is a `NullRecorder`) each step in
the run's timeline (`raytrain_ft.telemetry.timeline`: `loss`, `lr`,
`grad_norm`, `tokens_per_s`, `tokens_per_s_per_device`, `mfu` on GPU, `step_time_s`, `epoch`,
`checkpoint_stall_s`, `compute_s_per_seq_rank<r>` (each member's compute seconds per sequence,
`raytrain_ft.resilience.straggler`), and `val_loss`, `val_perplexity` at a validated step), the attempt's
`first_step` event with its recovery tables, and each skipped step (`skipped_steps` metric,
`skipped_step` event); rank 0 prints a progress line every `PROGRESS_EVERY` steps
(`progress_line`: step / max_steps, loss, tokens/s, ETA) that Ray streams to the driver. Every
rank prints its skips.

Step time (seconds) runs from `before_step` to `after_optimizer_step`: batch read, forward/backward,
clip, guard, optimizer (checkpoint stalls included; a validation, the save and the guards' checks
after the update are not). MFU = FLOPs per token x tokens/s / (peak FLOP/s per device x the step's devices)
(`raytrain_ft.model.causal_lm.flops_per_token`: PaLM, Appendix B; peak from `raytrain_ft.model.hardware`).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections import deque

import torch

from raytrain_ft.core.config import Config
from raytrain_ft.core.hooks import StepHook, StepResult
from raytrain_ft.core.recorder import Recorder
from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.model.causal_lm import flops_per_token
from raytrain_ft.model.hardware import peak_flops_per_device
from raytrain_ft.resilience.guards import SpikeGuard

log = logging.getLogger(__name__)


PROGRESS_EVERY = 5  # rank 0 logs a progress line every this many steps (and at an attempt's first step)
ETA_WINDOW = 20  # steps whose wall time the ETA extrapolates


def eta_seconds(ended: list[float], step_time_s: float, remaining: int) -> float:
    """Seconds until `remaining` more steps are done, at the mean wall time per step between the
    step ends in `ended` (seconds, oldest first: saves, guard checks and logging included); with
    fewer than two, at `step_time_s`."""
    per_step = (ended[-1] - ended[0]) / (len(ended) - 1) if len(ended) > 1 else step_time_s
    return remaining * per_step


def progress_line(step: int, max_steps: int, loss: float, grad_norm: float, tokens_per_s: float, eta_s: float) -> str:
    """`step 12/30 (40%) loss 4.1234 grad_norm 0.523 5120 tokens/s ETA 0:01:05` (ETA as h:mm:ss)."""
    eta = datetime.timedelta(seconds=round(eta_s))
    return (
        f"step {step}/{max_steps} ({100 * step // max_steps}%) loss {loss:.4f} grad_norm {grad_norm:.3f} "
        f"{tokens_per_s:.0f} tokens/s ETA {eta}"
    )


class StepMetrics(StepHook):
    """One rank's step reporting. `first_step`: the attempt's first step (the first this hook sees)."""

    def __init__(
        self,
        cfg: Config,
        plan: BatchPlan,
        seq_len: int,
        model: torch.nn.Module,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        position: DataPosition,
        guard: SpikeGuard,
        recorder: Recorder,
        rank: int,
    ):
        self.max_steps, self.plan, self.seq_len = cfg.train.max_steps, plan, seq_len
        self.scheduler, self.position, self.guard, self.recorder, self.rank = scheduler, position, guard, recorder, rank
        self.first_step: int | None = None
        self.first_batch_at = self.started = 0.0
        self.ended: deque[float] = deque(maxlen=ETA_WINDOW + 1)  # perf_counter at the end of the latest steps
        self.flops_per_token = flops_per_token(model, seq_len)
        self.peak_flops = peak_flops_per_device(cfg.scaling) if torch.cuda.is_available() else 0.0  # no MFU on CPU

    def before_step(self, step: int) -> None:
        self.started = time.perf_counter()
        if self.first_step is None:
            self.first_step = step

    def after_batch(self, step: int, micro_batches: list[dict]) -> None:
        if step == self.first_step:
            self.first_batch_at = time.time()  # a recovery phase (`raytrain_ft.resilience.recovery`)

    def after_optimizer_step(self, r: StepResult) -> None:
        self.log_step(r, time.perf_counter() - self.started - r.validation_s)
        if r.skipped:
            self.record_skip(r)

    def log_step(self, r: StepResult, step_time: float) -> None:
        tokens_per_s = self.plan.global_batch_size * self.seq_len / step_time
        throughput = {"tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / r.devices}
        if self.peak_flops and self.flops_per_token is not None:  # None: a mixture of experts
            throughput["mfu"] = self.flops_per_token * tokens_per_s / (self.peak_flops * r.devices)
        self.recorder.record_step(
            r.step,
            {
                "loss": r.loss,
                "lr": float(self.scheduler.get_last_lr()[0]),
                "grad_norm": r.grad_norm,
                **throughput,
                "step_time_s": step_time,
                "epoch": self.position.epoch,
                "checkpoint_stall_s": r.stall_s,
                **{f"compute_s_per_seq_rank{i}": t for i, t in enumerate(r.compute_s_per_seq)},
                **r.validation,
            },
            current={"last_step": r.step, "current_step_time_s": step_time},
            at=time.time(),
        )
        if r.step == self.first_step:
            self.recorder.event("first_step", step=r.step, first_batch_at=self.first_batch_at)
            self.recorder.write_recovery_tables()
        self.ended.append(time.perf_counter())
        if self.rank != 0:  # one progress line per step for the job's log
            return
        if r.step % PROGRESS_EVERY == 0 or r.step == self.first_step:
            eta_s = eta_seconds(list(self.ended), step_time, self.max_steps - r.step)
            log.info(progress_line(r.step, self.max_steps, r.loss, r.grad_norm, tokens_per_s, eta_s))
        if r.validation:
            log.info("step %d/%d val_loss %.4f", r.step, self.max_steps, r.validation["val_loss"])

    def record_skip(self, r: StepResult) -> None:
        log.warning("rank %d: skipped step %d: grad_norm %s vs median %s", self.rank, r.step, r.grad_norm, r.median)
        self.recorder.metrics(r.step, {"skipped_steps": self.guard.skipped})
        self.recorder.event("skipped_step", step=r.step, grad_norm=r.grad_norm, median=r.median)
