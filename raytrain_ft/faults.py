"""Fault injection for tests and demos: `faults: [{kind, step, rank}]` in the config.

Kinds: `raise` (an exception in the training loop), `kill` (SIGKILL of the worker process),
`kill_during_save` (the rank's checkpoint writer is slowed and the process is SIGKILLed while its
async write is in flight; `step` must be a checkpoint step), `nan` (the rank's loss becomes NaN),
`spike` (the rank's loss, and so its gradients, is multiplied by `factor`), `bitflip` (one bit of
one parameter flips on the rank after the optimizer step), `hang` (the rank sleeps `seconds` inside
the step), `slow` (a straggler: from `step` on, for `steps` steps, the rank's own compute takes
`factor` times as long: it sleeps `(factor - 1) x` its measured compute of the previous step
(`straggler.ComputeTimer`, the sleep itself not counted) inside its forward/backward, before its
gradients are ready, so the other ranks wait for it in the gradient all-reduce as they would for a
slow GPU; with `seconds` instead it sleeps that long there every step; the issue's `from_step` /
`until_step` are `step` / `step + steps`), `slow_save` (slow storage: the rank's
checkpoint writer sleeps `seconds` before writing each save, after creating the step folder),
`slow_restore` (slow storage on read: the rank's checkpoint reader sleeps `seconds` on the first
item of each restore, with the checkpoint file open: what `lsof` or `/proc/<pid>/fd` shows while a
restore is in progress, held long enough to be seen), `hold_reduce` (the rank holds `seconds` right
before the step's gradient reduction, after writing its marker: under replica recovery its peers
wait inside the gradient all-reduce meanwhile, so a test that kills the holding replica once the
marker exists kills it while its peers are in the all-reduce). `nan`, `spike`, `slow`, `slow_save` and
`slow_restore` last `steps` steps (`slow_restore`: restores of checkpoints of those steps); `rank: -1`
means every rank (the rank is the worker's rank in the run: under replica recovery the replica's
index, `Session.rank`). Each fault fires once per run: the firing rank writes
`<run folder>/faults/<index>-<step>.fired` first, so a restarted attempt (or the steps re-run after a
rollback) passes it; `slow`, `slow_save` and `slow_restore` are properties of the machine and fire on
every pass.

The injector is a step hook (`raytrain_ft.hooks`): `raise`/`kill` fire in `before_step`, `bitflip`
and `hang` in `after_optimizer_step`. `loss_factor`, `slow_down`, `before_reduce`, `save_delay_s`,
`after_save_started` and `restore_delay_s` change the step's (or the restore's) own values and are
called where they act.

Before a `raise`/`kill` fault, and before a `hang` sleeps, every rank calls `settle()`: the loop
finishes its in-flight save and waits until Ray registered the commit (the controller callback
acknowledges it), so the step a test expects the run to resume from does not depend on timing.
Real failures get no such courtesy, and resume is correct from any older committed checkpoint (see
the bitwise-resume tests).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable

import fsspec
import torch

from raytrain_ft.config import FaultSpec
from raytrain_ft.hooks import StepHook, StepResult
from raytrain_ft.run_folder import fault_marker

KILL_DURING_SAVE_DELAY_S = 3.0  # the kill comes 0.5 s after the save started: well inside the write


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws."""


class FaultInjector(StepHook):
    """One rank's faults. `settle`: the loop's (finish the in-flight save, wait for its commit);
    `param`: returns the tensor a `bitflip` corrupts (this rank's first parameter tensor or shard)."""

    def __init__(
        self,
        faults: list[FaultSpec],
        rank: int,
        run_root: str,
        settle: Callable[[], object],
        param: Callable[[], torch.Tensor],
    ):
        self.faults, self.rank, self.settle, self.param = list(enumerate(faults)), rank, settle, param
        self.run_root = run_root
        self.slept_s = 0.0  # the `slow` sleep inside the previous step's measured compute

    def _pending(self, step: int, kinds: tuple[str, ...]) -> list[tuple[int, FaultSpec]]:
        return [
            (i, f)
            for i, f in self.faults
            if f.kind in kinds
            and f.step <= step < f.step + max(1, f.steps if f.kind in ("nan", "spike") else 1)
            and not self._fired(i, step)
        ]

    def _mine(self, f: FaultSpec) -> bool:
        return f.rank in (-1, self.rank)

    def _fired(self, index: int, step: int) -> bool:
        fs, marker = fsspec.core.url_to_fs(fault_marker(self.run_root, index, step))
        return fs.exists(marker)

    def _mark(self, index: int, step: int) -> None:
        with fsspec.open(fault_marker(self.run_root, index, step), "w", auto_mkdir=True) as f:
            f.write(str(time.time()))

    def before_step(self, step: int) -> None:
        """Fire `raise` / `kill` faults due at `step` (called on every rank)."""
        due = self._pending(step, ("raise", "kill"))
        if not due:
            return
        self.settle()  # also a barrier: every rank has checked the markers before any is written
        for i, f in due:
            if self._mine(f):
                self._mark(i, step)
                if f.kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise InjectedFault(f"injected fault at step {step} on rank {self.rank}")

    def save_delay_s(self, step: int) -> float:
        """Seconds this rank's writer waits before writing the save of `step`: long enough for a
        `kill_during_save` to strike first, or a `slow_save` fault's `seconds`."""
        delay = self._slow_storage_s("slow_save", step)
        if any(self._mine(f) for _, f in self._pending(step, ("kill_during_save",))):
            delay = max(delay, KILL_DURING_SAVE_DELAY_S)
        return delay

    def restore_delay_s(self, step: int) -> float:
        """Seconds this rank's reader holds the restore of the checkpoint of `step` (`slow_restore` faults)."""
        return self._slow_storage_s("slow_restore", step)

    def _slow_storage_s(self, kind: str, step: int) -> float:
        """The `seconds` of this rank's `kind` faults (`slow_save`, `slow_restore`) that cover `step`."""
        return sum(
            f.seconds for _, f in self.faults if f.kind == kind and self._mine(f) and f.step <= step < f.step + f.steps
        )

    def before_reduce(self, step: int) -> None:
        """`hold_reduce`: mark, then hold this rank before the gradient reduction of `step`."""
        for i, f in self._pending(step, ("hold_reduce",)):
            if self._mine(f):
                self._mark(i, step)
                time.sleep(f.seconds)

    def slow_down(self, step: int, compute_s: float) -> None:
        """`slow`: sleep inside this rank's compute of `step` (`compute_s`: the previous step's
        measured compute seconds, the previous sleep included): `(factor - 1) x` its own compute, or
        `seconds`."""
        own_s, sleep_s = compute_s - self.slept_s, 0.0
        for f in (f for _, f in self.faults if f.kind == "slow" and self._mine(f)):
            if f.step <= step < f.step + f.steps:
                sleep_s += f.seconds or (f.factor - 1) * own_s
        self.slept_s = sleep_s
        time.sleep(sleep_s)

    def after_save_started(self, step: int) -> None:
        """SIGKILL this rank while its (slowed) write of `step` is in flight."""
        for i, f in self._pending(step, ("kill_during_save",)):
            if self._mine(f):
                self._mark(i, step)
                time.sleep(0.5)  # the writer thread is now inside its slowed write
                os.kill(os.getpid(), signal.SIGKILL)

    def loss_factor(self, step: int) -> float:
        """Multiplier of this rank's loss at `step`: 1, a spike's `factor`, or NaN."""
        factor = 1.0
        for i, f in self._pending(step, ("nan", "spike")):
            if self._mine(f):
                self._mark(i, step)
                factor *= math.nan if f.kind == "nan" else f.factor
        return factor

    def after_optimizer_step(self, result: StepResult) -> None:
        """`bitflip` (in `param()`) and `hang` faults of this rank at `result.step`."""
        step = result.step
        due = self._pending(step, ("bitflip", "hang"))
        if any(f.kind == "hang" for _, f in due):
            self.settle()  # the step a hung run resumes from must not depend on the save's timing
        for i, f in due:
            if self._mine(f):
                self._mark(i, step)
                if f.kind == "bitflip":
                    flip_bit(self.param())
                else:
                    time.sleep(f.seconds)


@torch.no_grad()
def flip_bit(param: torch.Tensor, bit: int = 20) -> None:
    """Flip one mantissa bit of the first element of a float32 parameter, in place."""
    param.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << bit)
