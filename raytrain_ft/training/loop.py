"""The data-parallel training loop, run on every rank. Depends on `torch.distributed`, not on Ray.

Read top to bottom: `train` builds a `Trainer` over its components (`raytrain_ft.training.run_components`:
the data pipeline, already filling from the committed checkpoint's data position, the model,
optimizer, schedule, the checkpointed state and the step hooks: construction only), calls
`Trainer.begin` (restore, the attempt's record and goodput account: `raytrain_ft.telemetry.attempt`;
the auto checkpoint interval: `checkpoint.interval.auto_schedule`), then runs `Trainer.step` once per
optimizer step: this rank's share of the global batch, at any world size (`data.position.BatchPlan`)
-> forward/backward over its `grad_accum_steps` passes -> gradient reduction across replicas -> clip
(global grad norm) -> spike guard, one decision for every member -> the step accepted or trained
again -> wait for the checkpoint snapshot -> optimizer step or skip -> LR scheduler -> advance the
data position -> held-out validation at its interval (`validation`) -> rank check and replica
fingerprint at their intervals, across the step's members -> roll back after persistent spikes, else
save (also before members leave: after a drain notice the members agreed on in the step,
`raytrain_ft.resilience.preemption`, or a straggler's exclusion, `raytrain_ft.resilience.straggler.Exclusion`;
then they leave as `raytrain_ft.resilience.leaving` says). Who trains a step, the split, the gradient
reduction across replicas, the agreed skip and whether the step counts are the step members'
(`replicas`: the whole group under restart recovery, a torchft quorum of replicas under replica
recovery); the loop calls them the same way in both modes.

What the loop records goes to a `Recorder` (`raytrain_ft.core.recorder`: rank 0's records, the other
ranks' is a `NullRecorder`; under replica recovery each step's participant of rank 0 records it,
`replicas.Role` says who starts the attempt); nothing is read back from it. What it decides with comes from the
checkpoint and from `Session.history` (`raytrain_ft.resilience.recovery.RunHistory`: the run's start and its
failures, attempt starts, hangs and rollbacks).

The per-step side work runs in step hooks (`raytrain_ft.core.hooks`), in this order: fault injection
(`faults`), the goodput ledger (`goodput.StepAccount`: every second of wall time in one bucket; rank
0's is checkpointed and recorded), step metrics and MFU (`step_metrics`), the straggler monitor and
the rebalance (`straggler`, `rebalance`), the data audit (`data.audit`), the progress beat to the
driver's watchdog (`watchdog`); `raytrain_ft.training.run_components` builds them in that order. Fault
injection that changes the step's own values (loss multiplier, slowed or killed checkpoint writes) is
called where it acts.
"""

from __future__ import annotations

import logging
import time

import torch

from raytrain_ft.checkpoint.interval import agreed_update, auto_schedule
from raytrain_ft.checkpoint.restore import corrupt_recorder, restore_latest
from raytrain_ft.checkpoint.train_state import KEY_GOODPUT, rng_key, seed_rngs
from raytrain_ft.core.config import Config
from raytrain_ft.core.errors import StorageFullError
from raytrain_ft.core.hooks import StepResult
from raytrain_ft.core.run_folder import end_run, step_path
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.model.causal_lm import lm_loss
from raytrain_ft.model.parallel import Parallel
from raytrain_ft.resilience.leaving import leave
from raytrain_ft.resilience.rebalance import rebalanced
from raytrain_ft.training.run_components import RunComponents
from raytrain_ft.training.session import Session

log = logging.getLogger(__name__)


def forward_backward(par: Parallel, plan: BatchPlan, passes: list[dict], loss_factor: float, device) -> float:
    """Accumulate gradients over this rank's passes (`data.batches.split_passes`), each weighted by
    `BatchPlan.pass_weight`: the gradient of the mean loss over the global batch's G sequences,
    whatever the world size and split. Returns this rank's weighted loss (the ranks' sum over W is
    the global mean loss). A pass without sequences (a rank whose share is shorter than the passes)
    runs the rank's first sequence at weight 0, so every rank runs the same collectives."""
    loss = torch.zeros((), device=device)
    for i, mb in enumerate(passes):
        n = len(mb["tokens"])
        tokens = (mb["tokens"] if n else passes[0]["tokens"][:1]).to(device, non_blocking=True)
        with par.micro_batch(last=i == len(passes) - 1):
            micro_loss = lm_loss(par.forward_module, tokens) * (loss_factor * plan.pass_weight(n))
        micro_loss.backward()
        loss += micro_loss.detach()
    return loss.item()


def rank_mean_loss(plan: BatchPlan, rank: int, weighted: float) -> float:
    """This rank's mean loss per sequence, from `forward_backward`'s weighted loss: comparable
    between ranks whose shares differ (the cross-rank spread check), unlike the weighted value."""
    return weighted / plan.pass_weight(plan.share(rank))


def train(cfg: Config, session: Session) -> None:
    """Train until `cfg.train.max_steps`, resuming from the session's latest checkpoint.

    Raises:
        ConfigError, DataError, CheckpointError: one-line user errors (see `raytrain_ft.core.errors`).
        GuardError: a guard ended the attempt (`raytrain_ft.resilience.guards`: an alert under
            `guards.on_alert: restart`, ranks disagreeing on a skip, no checkpoint to roll back to).
    """
    trainer = Trainer(cfg, session)
    trainer.begin()
    try:
        while trainer.progress.step < cfg.train.max_steps and not trainer.ended:
            trainer.step()
    except StorageFullError as e:  # every rank, at the same save: end the run instead of restarting
        if trainer.rank == 0:
            end_run(session.run_root, str(e))
        return
    if trainer.ended:  # stragglers excluded: the driver restarts without their nodes
        return
    trainer.finish()
    trainer.members.finish(session.run_root)


class Trainer(RunComponents):
    """One rank's training run: its components (`raytrain_ft.training.run_components`, built by the
    constructor: the data pipeline already filling from the committed checkpoint's data position),
    `begin()` restores and starts the attempt, then `step()` runs once per optimizer step."""

    def __init__(self, cfg: Config, session: Session):
        super().__init__(cfg, session, lambda: self.members, self.settle)
        self.save_due = self.done = self.ended = False

    def begin(self) -> None:
        """Start the attempt (every rank, collectives): restore the committed checkpoint (or an
        older one if it is corrupt), record the attempt and account its start (goodput), plan the
        auto checkpoint interval. Reads the run's past from `Session.history` only."""
        cfg, session = self.cfg, self.session
        history = session.history()  # every rank before the (collective) restore: before rank 0 adds to it
        restore_started = time.perf_counter()
        resumed_from, loaded, source = restore_latest(
            self.checkpointer,
            self.state,
            session.run_root,
            session.latest_checkpoint(),
            self.recorder,
            self.faults.reader_for,
            self.role.cleans,
            self.restore_memory,
        )
        self.memory.abandon_after(self.progress.step)  # copies of later steps are of a trajectory left behind
        if rng_key(self.rank) not in loaded:  # fresh start, or a rank added by an elastic resize
            seed_rngs(cfg.train.seed + self.progress.step, self.rank)
        self.beat.restored()  # restoring a large checkpoint is not a step
        self.members = self.build_members(self.progress.step)
        self.done = self.progress.step >= cfg.train.max_steps  # a finished run submitted again
        tags = self.par.tags() | self.checks.tags()
        restored = {"restored_from": source, "restore_s": round(time.perf_counter() - restore_started, 3)}
        started = resumed_from or 0, self.progress.step, tags, KEY_GOODPUT in loaded, self.done, restored
        self.attempt.start(history, *started)
        failures = self.world_size, history.failure_times(), history.run_start, self.progress.step, self.group
        if cfg.checkpoint.interval == "auto":
            self.schedule, mtbf_source = auto_schedule(cfg, *failures)
            self.attempt_recorder.tags({"mtbf_source": mtbf_source})
        if cfg.checkpoint.memory.interval == "auto" and self.memory.enabled:
            self.memory_schedule, _ = auto_schedule(cfg, *failures, memory=True)
        log.info("rank %d: start at step %d (%s)", self.rank, self.progress.step, self.plan.describe(self.rank))

    def restore_memory(self, durable_step: int) -> tuple[int, set[str], str] | None:
        """The memory tier's restore (`MemoryTier.restore`), what it passes over recorded."""
        on_skip = lambda line: self.recorder.event("memory_copy_skipped", reason=line)  # noqa: E731
        return self.memory.restore(self.state, durable_step, corrupt_recorder(self.recorder), on_skip)

    def after_memory_commit(self, done: tuple[int, bool] | None) -> None:
        """The memory tier's copies of a step are written everywhere (`MemoryTier.poll`): when they
        counted, keep what the step covers (the audited steps, the recorded timeline: a restart may
        resume from it) and replan its auto interval; else record that the step never counts."""
        if done is None:
            return
        step, counted = done
        if not counted:
            self.recorder.event("memory_checkpoint_not_committed", step=step)
            return
        self.audit.flush()
        self.recorder.committed(step)
        planned = agreed_update(self.memory_schedule, self.memory, self.beat.median_step_s, self.group)
        if planned:
            self.recorder.metrics(step, planned)
        self.recorder.goodput(step, self.ledger.summary(time.time()))

    def save(self, step: int) -> None:
        """Start the save of `step` (every rank); at most one is in flight: the previous one
        completes and is committed first (waiting for its write is a stall: slow storage shows here)."""
        self.after_commit(self.checkpointer.wait())
        self.checkpointer.save(step, self.state, self.faults.writer_for(step))

    def after_commit(self, step: int | None) -> None:
        """The checkpoint of `step` is complete on every rank (`Checkpointer.poll`/`wait`; None: none
        completed): commit it (`Session.commit`: a restart resumes from it), keep what it covers
        (the audited steps, the recorded timeline), replan the auto interval with the save's figures."""
        if step is None:
            return
        self.audit.flush()
        self.session.commit(step, step_path(self.session.run_root, step), {"step": step})
        self.recorder.committed(step)
        planned = agreed_update(self.schedule, self.checkpointer, self.beat.median_step_s, self.group)
        if planned:
            self.recorder.metrics(step, planned)
        self.recorder.goodput(step, self.ledger.summary(time.time()))
        self.recorder.refresh_loss_plot()

    def finish(self) -> None:
        """After the last step: wait for the final checkpoint; record the goodput summary and plot."""
        self.settle()
        if not self.done:  # a finished run submitted again: its account is closed
            self.ledger.add("checkpoint_stall", time.time())
            self.step_recorder.goodput(self.progress.step, self.ledger.summary(time.time()), final=True)
            self.step_recorder.refresh_loss_plot(wait=True)

    def step(self) -> None:
        """One optimizer step on every rank (collectives: all ranks call it together). Under replica
        recovery a step that is not accepted returns early, its data position unchanged: the next
        call trains the same sequences again (`raytrain_ft.resilience.replicas`)."""
        # who trains this step (a replica behind its peers heals here), at the split in force
        share = rebalanced(self.members.begin(), self.position.split)
        step = self.progress.step + 1
        self.hooks.before_step(step)
        passes = self.batches.take(self.position, share)
        self.hooks.after_batch(step, passes)
        with self.compute:  # this rank's compute seconds, its waits in collectives excluded
            self.faults.slow_down(step, self.compute.seconds, share.plan.shares[share.rank])
            weighted = forward_backward(self.par, share.plan, passes, self.faults.loss_factor(step), self.device)
        local_loss = rank_mean_loss(share.plan, share.rank, weighted)  # what the rank check compares
        self.faults.before_reduce(step)
        self.members.reduce(self.par)  # replicas: their gradients averaged over the step's participants
        grad_norm = self.par.clip_grad_norm_(self.cfg.train.grad_clip)
        skip, median = self.guard.judge(grad_norm)
        # the members' loss SUM, one skip decision, the fingerprint before a save, drained members (`Agreement`)
        may_save = self.members.saves and (self.save_due or self.schedule.due(step) or step == self.cfg.train.max_steps)
        loss_sum, skip, before_save, leaving, figures = self.members.agree(
            step, weighted, skip, may_save, self.preemption.take(), self.compute.seconds
        )
        if not self.members.accepted():  # a peer failed during the step: its time is lost to that failure
            self.optimizer.zero_grad(set_to_none=True)
            self.ledger.add("replacement", time.time())
            return
        self.guard.record(grad_norm, skip)
        self.checkpointer.wait_staged()  # the snapshots must be copied before the weights change
        self.memory.wait_staged()
        if not skip:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.progress.step = step
        self.position.advance(self.plan.global_batch_size, self.steps_per_epoch)
        val = self.validation.maybe_run(step)  # every rank (collectives); empty when not due
        loss, stall_s = loss_sum / share.plan.world_size, self.checkpointer.take_stall_s() + self.memory.take_stall_s()
        members_figures = (self.members.recovering_s, share.plan.world_size, figures, share.plan.shares)
        result = StepResult(step, loss, grad_norm, skip, median, stall_s, val.metrics, val.seconds, *members_figures)
        self.hooks.after_optimizer_step(result)  # the straggler monitor's exclusions are decided here
        # the fingerprint before a save: a periodic or final one (`before_save`), or the one before leaving
        self.checks.monitor(step, local_loss, grad_norm, before_save or leaving > 0 or bool(self.stragglers.excluded()))
        if self.guard.consecutive >= self.cfg.guards.spike.max_consecutive_skips:
            self.after_commit(self.checkpointer.wait())  # a rollback reloads with no save in flight
            self.roll_back(step, self.guard.consecutive)
            self.memory.abandon_after(self.progress.step)
            self.schedule.saved(self.progress.step)
        else:
            self.after_commit(self.checkpointer.poll())
            self.after_memory_commit(self.memory.poll())
            self.maybe_save(step, leaving)
        self.hooks.after_step(step)

    def maybe_save(self, step: int, leaving: int) -> None:
        """Periodic and final saves (none during a skip streak); before members leave (`leaving` hold a
        drain notice; `StragglerMonitor.excluded`), the just-in-time save of the members that keep the
        step durable, then `raytrain_ft.resilience.leaving.leave` (`self.ended`: the attempt ends)."""
        # auto: never start a save while the previous one is still writing (writes must not queue)
        self.save_due |= self.schedule.due(step) and not (self.schedule.auto and self.checkpointer.pending)
        final = step == self.cfg.train.max_steps
        if (self.save_due and self.guard.consecutive == 0) or final:
            if self.members.saves and self.checks.fit_to_save(step):  # the final save too: never a diverged one
                self.save(step)
                self.faults.after_save_started(step)
            self.schedule.saved(step)  # after a failed replica check too: the next try is an interval later
            self.save_due = False
        elif self.memory.enabled and self.memory_schedule.due(step) and self.guard.consecutive == 0:
            if not self.memory.pending and self.checks.fit_to_save(step):  # a copy never holds diverged replicas
                self.memory.save(step, self.state)
            self.memory_schedule.saved(step)
        excluded = self.stragglers.excluded()
        if leaving or excluded:  # never a diverged save before leaving either: withheld, as any other
            saves = self.members.saves_before_leaving(leaving + len(excluded))
            saved = saves and self.checks.fit_to_save(step)
            if saved and (self.checkpointer.pending is None or self.checkpointer.pending[0] != step):
                self.save(step)
                self.schedule.saved(step)
            self.ended |= leave(
                step, excluded, saves, saved, self.members, self.preemption, self.stragglers, self.settle
            )

    def settle(self) -> None:
        """Finish and commit the in-flight saves (both tiers) and wait until the runtime registered every commit."""
        self.after_memory_commit(self.memory.wait())
        self.after_commit(self.checkpointer.wait())
        self.session.flush()
        self.recorder.registered()
