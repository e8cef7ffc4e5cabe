"""Fault injection for tests and demos: `faults: [{kind, step, rank}]` in the config.

Kinds: `raise` (an exception in the training loop), `kill` (SIGKILL of the worker process),
`kill_during_save` (the rank's checkpoint writer is slowed and the process is SIGKILLed while its
async write is in flight; `step` must be a checkpoint step). Each fault fires once per run: the
firing rank writes `<run folder>/faults/<index>.fired` first, so the restarted attempt passes it.

Before a step with a pending fault every rank calls `settle()`: the loop finishes its in-flight save
and waits until Ray registered the commit (the controller callback acknowledges it), so the step a test expects the
run to resume from does not depend on timing. Real failures get no such courtesy, and resume is correct
from any older committed checkpoint (see the bitwise-resume tests).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import fsspec

from raytrain_ft.config import FaultSpec


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws."""


class FaultInjector:
    def __init__(self, faults: list[FaultSpec], rank: int, run_root: str):
        self.faults, self.rank = list(enumerate(faults)), rank
        self.fs, base = fsspec.core.url_to_fs(run_root)
        self.marker_dir = f"{base.rstrip('/')}/faults"

    def _pending(self, step: int, kinds: tuple[str, ...]) -> list[tuple[int, FaultSpec]]:
        return [
            (i, f)
            for i, f in self.faults
            if f.step == step and f.kind in kinds and not self.fs.exists(f"{self.marker_dir}/{i}.fired")
        ]

    def _mark(self, index: int) -> None:
        self.fs.makedirs(self.marker_dir, exist_ok=True)
        with self.fs.open(f"{self.marker_dir}/{index}.fired", "w") as f:
            f.write(str(time.time()))

    def before_step(self, step: int, settle: Callable[[], object]) -> None:
        """Fire `raise` / `kill` faults due at `step` (called on every rank)."""
        due = self._pending(step, ("raise", "kill"))
        if not due:
            return
        settle()  # also a barrier: every rank has checked the markers before any is written
        for i, f in due:
            if f.rank == self.rank:
                self._mark(i)
                if f.kind == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise InjectedFault(f"injected fault at step {step} on rank {self.rank}")

    def slow_save(self, step: int) -> bool:
        """True on the rank that must be killed during the save of `step`."""
        return any(f.rank == self.rank for _, f in self._pending(step, ("kill_during_save",)))

    def after_save_started(self, step: int) -> None:
        """SIGKILL this rank while its (slowed) write of `step` is in flight."""
        for i, f in self._pending(step, ("kill_during_save",)):
            if f.rank == self.rank:
                self._mark(i)
                time.sleep(0.5)  # the writer thread is now inside its slowed write
                os.kill(os.getpid(), signal.SIGKILL)
