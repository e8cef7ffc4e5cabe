"""Fault injection for tests and demos: `faults: [{kind, step, rank}]` in the config.

Kinds: `raise` (an exception in the training loop), `kill` (SIGKILL of the worker process); both
fire before the step by default, or with `at: save` while the rank's async write of the checkpoint
of `step` is in flight (`step` must be a checkpoint step; the rank's writer is slowed, and the
fault fires 0.5 s into its write, before its first byte, the save neither finished nor committed);
a `kill` also `at: write` (the rank's write thread SIGKILLs the process once the first item of its
file is on storage: a file cut short) or `at: metadata` (rank 0, the save's coordinator, once
every rank's files are written, before `.metadata`): `raytrain_ft.resilience.storage_faults.CutWriter`;
`nan` (the rank's loss becomes NaN),
`spike` (the rank's loss, and so its gradients, is multiplied by `factor`), `bitflip` (one bit of
one parameter flips on the rank after the optimizer step), `hang` (the rank sleeps `seconds` inside
the step), `slow` (a straggler: from `step` on, for `steps` steps, the rank's own compute takes
`factor` times as long: it sleeps `(factor - 1) x` its measured compute of the previous step
(`straggler.ComputeTimer`, the sleep itself not counted) inside its forward/backward, before its
gradients are ready, so the other ranks wait for it in the gradient all-reduce as they would for a
slow GPU; with `seconds` instead it sleeps that long there every step; the issue's `from_step` /
`until_step` are `step` / `step + steps`), `device` (a simulated accelerator, for benchmarks that
must not depend on the host's cores: from `step` on, for `steps` steps, the rank waits `seconds` per
sequence of its share of the step, times `1 + u` with u uniform in [-`jitter`, `jitter`] drawn from
(step, rank), inside its forward/backward and holding no CPU, as a host waits for its GPU; a `slow`
fault on the same rank scales that wait with its own compute), `slow_save` (slow storage: the rank's
checkpoint writer sleeps `seconds` before writing each save, after creating the step folder),
`slow_restore` (slow storage on read: the rank's checkpoint reader sleeps `seconds` on the first
item of each restore, with the checkpoint file open: what `lsof` or `/proc/<pid>/fd` shows while a
restore is in progress, held long enough to be seen), `hold_reduce` (the rank holds `seconds` right
before the step's gradient reduction, after writing its marker: under replica recovery its peers
wait inside the gradient all-reduce meanwhile, so a test that kills the holding replica once the
marker exists kills it while its peers are in the all-reduce), `freeze` (SIGSTOP of the rank's own
process, as a device or a host that stops answering freezes it; its moment is `at`: `start`, as
the rank starts restoring the checkpoint of `step`, its peers inside the restore's collectives;
`reduce`, right before the gradient reduction across replicas of `step` (`before_reduce`; under DDP
after the backward's all-reduce), its peers inside the step's next collective; `save`,
while its write of the checkpoint of `step` is in flight, slowed as for `kill` at `save`, its
peers in the next step's all-reduce; the driver's progress watchdog, `raytrain_ft.resilience.watchdog`, is what
ends it). Three kinds kill the rank at a moment of a
worker-group start instead of at a step: `kill_in_setup` (right after Ray Train set up the process group,
before the start completes), `kill_at_launch` (once Ray launched the train function, before the start
returns to the controller) and `kill_at_first_step` (before the first step of an attempt); each fires at
the first start that resumes from step `step` or later, so several of them in a row are failures that
cluster (the first two are fired on the controller by `raytrain_ft.launch.start_faults`). `nan`, `spike`,
`slow`, `slow_save` and `slow_restore` last `steps` steps (`slow_restore`: restores of checkpoints of those
steps); `rank: -1` means every rank (the rank is the worker's rank in the run: under replica recovery the replica's
index, `Session.rank`). Each fault fires once per run: the firing rank writes
`<run folder>/faults/<index>-<step>.fired` first, so a restarted attempt (or the steps re-run after a
rollback) passes it; `slow`, `slow_save` and `slow_restore` are properties of the machine and fire on
every pass.

The injector is a step hook (`raytrain_ft.core.hooks`): `raise`/`kill` fire in `before_step` (at `save`:
in `after_save_started`; at `write` and `metadata`: in the writer `writer_for` hands the checkpointer),
`bitflip` and `hang` in `after_optimizer_step`; `freeze` in `reader_for`, `before_reduce` or
`after_save_started` (its `at`). `loss_factor`, `slow_down`, `before_reduce`, `writer_for`,
`after_save_started` and `reader_for` change the step's (or the save's, or the restore's) own
values and are called where they act; the slowed and cut writers and the slowed reader are
`raytrain_ft.resilience.storage_faults`'.

Before a `raise`/`kill` fault (not one at `save`: it strikes the save itself), before a `hang`
sleeps and before a `freeze` at `reduce` or `save`, every rank calls `settle()`: the loop finishes
its in-flight save and waits until Ray registered the commit (the controller callback acknowledges
it), so the step a test expects the run to resume from does not depend on timing. Real failures get
no such courtesy, and resume is correct from any older committed checkpoint (see the bitwise-resume
tests).
"""

from __future__ import annotations

import math
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable

import fsspec
import torch

from raytrain_ft.checkpoint.checkpointer import WriterFactory
from raytrain_ft.checkpoint.integrity import ChecksummedReader, ChecksummedWriter
from raytrain_ft.core.fault_spec import FaultSpec
from raytrain_ft.core.hooks import StepHook, StepResult
from raytrain_ft.core.run_folder import fault_marker
from raytrain_ft.model.parallel import Parallel
from raytrain_ft.resilience.storage_faults import CutWriter, SlowReader, SlowWriter

SAVE_FAULT_DELAY_S = 3.0  # a fault at `save` comes 0.5 s after the save started: well inside the write


START_KINDS = ("kill_in_setup", "kill_at_launch", "kill_at_first_step")


def fired(run_root: str, index: int, step: int) -> bool:
    """Whether fault `index` of the run in `run_root` fired at `step` (its marker exists)."""
    fs, marker = fsspec.core.url_to_fs(fault_marker(run_root, index, step))
    return fs.exists(marker)


def mark(run_root: str, index: int, step: int) -> None:
    """Write the marker of fault `index` at `step`: it fired (once per run). Its content, the unix
    time it fired, is whole when the marker exists (a temporary file of this writer renamed: a fault
    of every rank is marked by each rank at once): a reader polling for it never reads it half-written."""
    fs, marker = fsspec.core.url_to_fs(fault_marker(run_root, index, step))
    fs.makedirs(marker.rsplit("/", 1)[0], exist_ok=True)
    tmp = f"{marker}.{uuid.uuid4().hex}.tmp"
    with fs.open(tmp, "w") as f:
        f.write(str(time.time()))
    fs.mv(tmp, marker)


def start_faults_due(
    faults: list[tuple[int, FaultSpec]], kind: str, resumes_from: int, run_root: str
) -> list[tuple[int, FaultSpec]]:
    """The first `kind` fault (one of `START_KINDS`; `faults`: (index, spec) in list order) due at a group
    start that resumes from step `resumes_from`: its `step` <= `resumes_from` and not fired yet; [] when
    none. One per start: the next start fires the next."""
    due = [(i, f) for i, f in faults if f.kind == kind and f.step <= resumes_from and not fired(run_root, i, f.step)]
    return due[:1]


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws."""


class FaultInjector(StepHook):
    """One rank's faults. `settle`: the loop's (finish the in-flight save, wait for its commit,
    `raytrain_ft.training.commits.Commits.settle`); `par`: the model, whose first parameter tensor
    (or shard) on this rank a `bitflip` corrupts."""

    def __init__(
        self,
        faults: list[FaultSpec],
        rank: int,
        run_root: str,
        settle: Callable[[], object],
        par: Parallel,
    ):
        self.faults, self.rank, self.settle, self.par = list(enumerate(faults)), rank, settle, par
        self.run_root, self.first_step = run_root, True
        self.slept_s = 0.0  # the `slow` sleep inside the previous step's measured compute

    def _pending(self, step: int, kinds: tuple[str, ...]) -> list[tuple[int, FaultSpec]]:
        return [
            (i, f)
            for i, f in self.faults
            if f.kind in kinds
            and f.step <= step < f.step + max(1, f.steps if f.kind in ("nan", "spike") else 1)
            and not self._fired(i, step)
        ]

    def _freezes(self, step: int, at: str) -> list[tuple[int, FaultSpec]]:
        return [(i, f) for i, f in self._pending(step, ("freeze",)) if (f.at or "reduce") == at]

    def _failures(self, step: int, at: str) -> list[tuple[int, FaultSpec]]:
        """`raise` / `kill` faults due at `step` at moment `at` ("": before the step; "save", "write",
        "metadata": in the save of `step`)."""
        return [(i, f) for i, f in self._pending(step, ("raise", "kill")) if f.at == at]

    def _freeze(self, index: int, step: int) -> None:
        self._mark(index, step)
        # Every thread stops; only a SIGKILL (or SIGCONT) ends it. Sent to this thread, not the process:
        # a process-directed signal let this thread run on for a moment (seen in py-spy's dump: past the point).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)

    def _mine(self, f: FaultSpec) -> bool:
        return f.rank in (-1, self.rank)

    def _fired(self, index: int, step: int) -> bool:
        return fired(self.run_root, index, step)

    def _mark(self, index: int, step: int) -> None:
        mark(self.run_root, index, step)

    def before_step(self, step: int) -> None:
        """Fire `raise` / `kill` faults due at `step`, and `kill_at_first_step` faults due at this attempt's
        first step (`step`: the attempt resumed from `step - 1`) (called on every rank)."""
        due = self._failures(step, "")
        if self.first_step:
            due += start_faults_due(self.faults, "kill_at_first_step", step - 1, self.run_root)
            self.first_step = False
        if not due:
            return
        self.settle()  # also a barrier: every rank has checked the markers before any is written
        for i, f in due:
            if self._mine(f):
                self._mark(i, f.step if f.kind in START_KINDS else step)
                if f.kind != "raise":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise InjectedFault(f"injected fault at step {step} on rank {self.rank}")

    def writer_for(self, step: int) -> WriterFactory:
        """The storage writer of this rank's save of `step` (`raytrain_ft.resilience.storage_faults`):
        a `CutWriter` for a `kill` at `write` or `metadata`; a `SlowWriter` holding the write long
        enough for a fault at `save` to strike first, or for a `slow_save` fault's `seconds`; else
        the plain `ChecksummedWriter`."""
        cuts = [(i, f) for i, f in self._failures(step, "write") + self._failures(step, "metadata") if self._mine(f)]
        if cuts:
            (index, cut), *_ = cuts
            return lambda path: CutWriter(path, cut.at, lambda: self._mark(index, step))
        delay = self._slow_storage_s("slow_save", step)
        if self._freezes(step, "save"):
            self.settle()  # the step the frozen run resumes from must not depend on the last save's timing
        held = self._failures(step, "save") + self._freezes(step, "save")
        if any(self._mine(f) for _, f in held):
            delay = max(delay, SAVE_FAULT_DELAY_S)
        return (lambda path: SlowWriter(path, delay)) if delay > 0 else ChecksummedWriter

    def reader_for(self, step: int) -> Callable[[str], ChecksummedReader]:
        """The reader of this rank's restore of the checkpoint of `step`: a `SlowReader` holding it
        for `slow_restore` faults' `seconds`, else the plain `ChecksummedReader`; a `freeze` at
        `start` of `step` stops the rank here instead."""
        for i, f in self._freezes(step, "start"):
            if self._mine(f):
                self._freeze(i, step)
        delay = self._slow_storage_s("slow_restore", step)
        return (lambda path: SlowReader(path, delay)) if delay > 0 else ChecksummedReader

    def _slow_storage_s(self, kind: str, step: int) -> float:
        """The `seconds` of this rank's `kind` faults (`slow_save`, `slow_restore`) that cover `step`."""
        return sum(
            f.seconds for _, f in self.faults if f.kind == kind and self._mine(f) and f.step <= step < f.step + f.steps
        )

    def before_reduce(self, step: int) -> None:
        """`hold_reduce`: mark, then hold this rank before the gradient reduction of `step`; `freeze`
        at `reduce`: settle (every rank), mark, stop."""
        for i, f in self._pending(step, ("hold_reduce",)):
            if self._mine(f):
                self._mark(i, step)
                time.sleep(f.seconds)
        freezes = self._freezes(step, "reduce")
        if freezes:
            self.settle()  # the step the frozen run resumes from must not depend on the save's timing
        for i, f in freezes:
            if self._mine(f):
                self._freeze(i, step)

    def slow_down(self, step: int, compute_s: float, sequences: int, members: int) -> None:
        """`slow` and `device`: sleep `wait_s(...)` inside this rank's compute of `step`."""
        time.sleep(self.wait_s(step, compute_s, sequences, members))

    def wait_s(self, step: int, compute_s: float, sequences: int, members: int) -> float:
        """Seconds of the `slow` and `device` waits of `step` on this rank. `slow`: `(factor - 1) x`
        its own compute (`compute_s`: the previous step's measured compute seconds, less the previous
        `slow` wait: a `device` wait counts as the rank's own compute), or `seconds`, in the steps of
        fewer than `until_members` members when it is set (`members`: the step's); `device`:
        `seconds x sequences` (this rank's share of the step) `x (1 + u)` (module doc)."""
        own_s, slow_s, device_s = compute_s - self.slept_s, 0.0, 0.0
        for f in (f for _, f in self.faults if f.kind in ("slow", "device") and self._mine(f)):
            if not f.step <= step < f.step + f.steps or 0 < f.until_members <= members:
                continue
            if f.kind == "device":
                u = random.Random(step * 1_000_003 + self.rank).uniform(-f.jitter, f.jitter)
                device_s += f.seconds * sequences * (1 + u)
            else:
                slow_s += f.seconds or (f.factor - 1) * own_s
        self.slept_s = slow_s
        return slow_s + device_s

    def after_save_started(self, step: int) -> None:
        """Raise, SIGKILL or SIGSTOP this rank (`raise`, `kill`, `freeze` at `save`) while its (slowed)
        write of `step` is in flight."""
        for i, f in self._failures(step, "save") + self._freezes(step, "save"):
            if self._mine(f):
                time.sleep(0.5)  # the writer thread is now inside its slowed write
                if f.kind == "freeze":
                    self._freeze(i, step)
                self._mark(i, step)
                if f.kind == "raise":
                    raise InjectedFault(f"injected fault at step {step} on rank {self.rank}, its save in flight")
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
                    flip_bit(self.par.local_parameters()[0])
                else:
                    time.sleep(f.seconds)


@torch.no_grad()
def flip_bit(param: torch.Tensor, bit: int = 20) -> None:
    """Flip one mantissa bit of the first element of a float32 parameter, in place."""
    param.view(-1)[:1].view(torch.int32).bitwise_xor_(1 << bit)
