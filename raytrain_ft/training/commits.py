"""Saves and their commits, both tiers: what a complete checkpoint sets off on every rank.

`Commits.save` starts a durable save (at most one is in flight: the previous one completes and is
committed first). Once a tier's copies of a step are complete on every rank (`Checkpointer.poll` /
`wait`, `MemoryTier.poll` / `wait`), `after_commit` / `after_memory_commit` commit it (a durable one
through `Session.commit`: a restart resumes from it), keep what it covers (the data audit's steps,
the recorded timeline) and replan the tier's auto interval from the save's figures
(`checkpoint.interval.agreed_update`). `settle` finishes and commits the saves in flight and waits
until the runtime registered every commit: the loop calls it at the run's end, the fault injector
and the guards before they end an attempt.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from raytrain_ft.checkpoint.checkpointer import Checkpointer, WriterFactory
from raytrain_ft.checkpoint.interval import CheckpointSchedule, agreed_update
from raytrain_ft.checkpoint.memory_tier import MemoryTier
from raytrain_ft.checkpoint.train_state import TrainState
from raytrain_ft.core.recorder import Recorder
from raytrain_ft.core.run_folder import step_path
from raytrain_ft.data.audit import DataAudit
from raytrain_ft.resilience.watchdog import StepBeat
from raytrain_ft.telemetry.goodput import GoodputLedger
from raytrain_ft.training.session import Session


class Commits:
    """One rank's saves and commits of both tiers (module doc).

    `schedule` and `memory_schedule`: the tiers' checkpoint intervals, replaced by the loop when it
    plans an auto interval at the attempt's start (`Trainer.begin`) and replanned here after each
    commit. `group`: the CPU gloo group the replanning agrees over (every rank gets the same interval).
    """

    def __init__(
        self,
        session: Session,
        state: TrainState,
        checkpointer: Checkpointer,
        memory: MemoryTier,
        recorder: Recorder,
        audit: DataAudit,
        ledger: GoodputLedger,
        beat: StepBeat,
        group: dist.ProcessGroup,
        schedules: tuple[CheckpointSchedule, CheckpointSchedule],
    ):
        self.session, self.state, self.checkpointer, self.memory = session, state, checkpointer, memory
        self.recorder, self.audit, self.ledger, self.beat, self.group = recorder, audit, ledger, beat, group
        self.schedule, self.memory_schedule = schedules

    def save(self, step: int, writer: WriterFactory) -> None:
        """Start the durable save of `step` (every rank) with `writer` (`FaultInjector.writer_for`);
        the previous one completes and is committed first (waiting for its write is a stall: slow
        storage shows here)."""
        self.after_commit(self.checkpointer.wait())
        self.checkpointer.save(step, self.state, writer)

    def after_commit(self, step: int | None) -> None:
        """The durable checkpoint of `step` is complete on every rank (None: none completed): commit
        it, keep what it covers, replan the auto interval (module doc)."""
        if step is None:
            return
        self.audit.flush()
        self.session.commit(step, step_path(self.session.run_root, step), {"step": step})
        self.recorder.committed(step)
        self._replanned(step, self.schedule, self.checkpointer)
        self.recorder.refresh_loss_plot()

    def after_memory_commit(self, done: tuple[int, bool] | None) -> None:
        """The memory tier's copies of a step are written everywhere (`MemoryTier.poll`): when they
        counted, keep what the step covers (a restart may resume from it) and replan its auto
        interval; else record that the step never counts."""
        if done is None:
            return
        step, counted = done
        if not counted:
            self.recorder.event("memory_checkpoint_not_committed", step=step)
            return
        self.audit.flush()
        self.recorder.committed(step)
        self._replanned(step, self.memory_schedule, self.memory)

    def _replanned(self, step: int, schedule: CheckpointSchedule, tier: Checkpointer | MemoryTier) -> None:
        planned = agreed_update(schedule, tier, self.beat.median_step_s, self.group)
        if planned:
            self.recorder.metrics(step, planned)
        self.recorder.goodput(step, self.ledger.summary(time.time()))

    def settle(self) -> None:
        """Finish and commit the in-flight saves (both tiers) and wait until the runtime registered every commit."""
        self.after_memory_commit(self.memory.wait())
        self.after_commit(self.checkpointer.wait())
        self.session.flush()
        self.recorder.registered()
