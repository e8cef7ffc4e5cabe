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

from raytrain_ft.checkpoint.interval import auto_schedule
from raytrain_ft.checkpoint.restore import corrupt_recorder, restore_latest
from raytrain_ft.checkpoint.train_state import KEY_GOODPUT, rng_key, seed_rngs
from raytrain_ft.core.config import Config
from raytrain_ft.core.errors import StorageFullError
from raytrain_ft.core.hooks import StepResult
from raytrain_ft.core.run_folder import end_run
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
    trainer = Trainer(RunComponents(cfg, session))
    trainer.begin()
    try:
        while trainer.c.progress.step < cfg.train.max_steps and not trainer.ended:
            trainer.step()
    except StorageFullError as e:  # every rank, at the same save: end the run instead of restarting
        if trainer.c.rank == 0:
            end_run(session.run_root, str(e))
        return
    if trainer.ended:  # stragglers excluded: the driver restarts without their nodes
        return
    trainer.finish()
    trainer.c.members.finish(session.run_root)


class Trainer:
    """One rank's training run over its components `c` (`raytrain_ft.training.run_components`: the
    data pipeline already filling from the committed checkpoint's data position, the model, the
    step members, the saves and commits): `begin()` restores and starts the attempt, then `step()`
    runs once per optimizer step."""

    def __init__(self, components: RunComponents):
        self.c = components
        self.save_due = self.done = self.ended = False

    def begin(self) -> None:
        """Start the attempt (every rank, collectives): restore the committed checkpoint (or an
        older one if it is corrupt), start the step members at the restored step, record the
        attempt and account its start (goodput), plan the auto checkpoint intervals. Reads the run's
        past from `Session.history` only."""
        c, cfg, session = self.c, self.c.cfg, self.c.session
        history = session.history()  # every rank before the (collective) restore: before rank 0 adds to it
        restore_started = time.perf_counter()
        resumed_from, loaded, source = restore_latest(
            c.checkpointer,
            c.state,
            session.run_root,
            session.latest_checkpoint(),
            c.recorder,
            c.faults.reader_for,
            c.role.cleans,
            self.restore_memory,
        )
        # copies of later steps are of a trajectory left behind: deleted by the rank that starts the attempt
        c.memory.abandon_after(c.progress.step, c.role.attempt)
        if rng_key(c.rank) not in loaded:  # fresh start, or a rank added by an elastic resize
            seed_rngs(cfg.train.seed + c.progress.step, c.rank)
        c.beat.restored()  # restoring a large checkpoint is not a step
        c.members.start(c.progress.step, {"audit": c.audit})
        self.done = c.progress.step >= cfg.train.max_steps  # a finished run submitted again
        tags = c.par.tags() | c.checks.tags()
        restored = {"restored_from": source, "restore_s": round(time.perf_counter() - restore_started, 3)}
        started = resumed_from or 0, c.progress.step, tags, KEY_GOODPUT in loaded, self.done, restored
        c.attempt.start(history, *started)
        failures = c.world_size, history.failure_times(), history.run_start, c.progress.step, c.group
        if cfg.checkpoint.interval == "auto":
            c.commits.schedule, mtbf_source = auto_schedule(cfg, *failures)
            c.attempt_recorder.tags({"mtbf_source": mtbf_source})
        if cfg.checkpoint.memory.interval == "auto" and c.memory.enabled:
            c.commits.memory_schedule, _ = auto_schedule(cfg, *failures, memory=True)
        log.info("rank %d: start at step %d (%s)", c.rank, c.progress.step, c.plan.describe(c.rank))

    def restore_memory(self, durable_step: int) -> tuple[int, set[str], str] | None:
        """The memory tier's restore (`MemoryTier.restore`), what it passes over recorded."""
        recorder = self.c.recorder
        on_skip = lambda line: recorder.event("memory_copy_skipped", reason=line)  # noqa: E731
        return self.c.memory.restore(self.c.state, durable_step, corrupt_recorder(recorder), on_skip)

    def save(self, step: int) -> None:
        """Start the durable save of `step` (every rank; `Commits.save`) with its fault injection."""
        self.c.commits.save(step, self.c.faults.writer_for(step))

    def finish(self) -> None:
        """After the last step: wait for the final checkpoint; record the goodput summary and plot."""
        c = self.c
        c.commits.settle()
        if not self.done:  # a finished run submitted again: its account is closed
            c.ledger.add("checkpoint_stall", time.time())
            c.step_recorder.goodput(c.progress.step, c.ledger.summary(time.time()), final=True)
            c.step_recorder.refresh_loss_plot(wait=True)

    def step(self) -> None:
        """One optimizer step on every rank (collectives: all ranks call it together). Under replica
        recovery a step that is not accepted returns early, its data position unchanged: the next
        call trains the same sequences again (`raytrain_ft.resilience.replicas`)."""
        c, commits = self.c, self.c.commits
        # who trains this step (a replica behind its peers heals here), at the split in force
        share = rebalanced(c.members.begin(), c.position.split)
        step = c.progress.step + 1
        c.hooks.before_step(step)
        passes = c.batches.take(c.position, share)
        c.hooks.after_batch(step, passes)
        with c.compute:  # this rank's compute seconds, its waits in collectives excluded
            c.faults.slow_down(step, c.compute.seconds, share.plan.shares[share.rank], share.plan.world_size)
            weighted = forward_backward(c.par, share.plan, passes, c.faults.loss_factor(step), c.device)
        local_loss = rank_mean_loss(share.plan, share.rank, weighted)  # what the rank check compares
        c.faults.before_reduce(step)
        c.members.reduce(c.par)  # replicas: their gradients averaged over the step's participants
        grad_norm = c.par.clip_grad_norm_(c.cfg.train.grad_clip)
        skip, median = c.guard.judge(grad_norm)
        # the members' loss SUM, one skip decision, the fingerprint before a save, drained members (`Agreement`)
        due = self.save_due or commits.schedule.due(step) or step == c.cfg.train.max_steps
        may_save = c.members.saves and (due or (c.memory.enabled and commits.memory_schedule.due(step)))
        loss_sum, skip, before_save, leaving, figures = c.members.agree(
            step, weighted, skip, may_save, c.preemption.take(), c.compute.seconds
        )
        if not c.members.accepted():  # a peer failed during the step: its time is lost to that failure
            c.optimizer.zero_grad(set_to_none=True)
            c.ledger.add("replacement", time.time())
            return
        c.guard.record(grad_norm, skip)
        c.checkpointer.wait_staged()  # the snapshots must be copied before the weights change
        c.memory.wait_staged()
        if not skip:
            c.optimizer.step()
        c.optimizer.zero_grad(set_to_none=True)
        c.scheduler.step()
        c.progress.step = step
        c.position.advance(c.plan.global_batch_size, c.steps_per_epoch)
        val = c.validation.maybe_run(step)  # every rank (collectives); empty when not due
        loss, stall_s = loss_sum / share.plan.world_size, c.checkpointer.take_stall_s() + c.memory.take_stall_s()
        members_figures = (c.members.recovering_s, share.plan.world_size, figures, share.plan.shares)
        result = StepResult(step, loss, grad_norm, skip, median, stall_s, val.metrics, val.seconds, *members_figures)
        c.hooks.after_optimizer_step(result)  # the straggler monitor's exclusions are decided here
        # the fingerprint before a save: a periodic or final one (`before_save`), or the one before leaving
        c.checks.monitor(step, local_loss, grad_norm, before_save or leaving > 0 or bool(c.stragglers.excluded()))
        if c.guard.consecutive >= c.cfg.guards.spike.max_consecutive_skips:
            commits.after_commit(c.checkpointer.wait())  # a rollback reloads with no save in flight
            c.roll_back(step, c.guard.consecutive)
            c.memory.abandon_after(c.progress.step, c.members.saves and c.rank == 0)  # one member: the saver
            commits.schedule.saved(c.progress.step)
        else:
            commits.after_commit(c.checkpointer.poll())
            commits.after_memory_commit(c.memory.poll())
            self.maybe_save(step, leaving)
        c.hooks.after_step(step)

    def maybe_save(self, step: int, leaving: int) -> None:
        """Periodic and final saves (none during a skip streak); before members leave (`leaving` hold a
        drain notice; `StragglerMonitor.excluded`), the just-in-time save of the members that keep the
        step durable, then `raytrain_ft.resilience.leaving.leave` (`self.ended`: the attempt ends)."""
        c, schedule = self.c, self.c.commits.schedule
        # auto: never start a save while the previous one is still writing (writes must not queue)
        self.save_due |= schedule.due(step) and not (schedule.auto and c.checkpointer.pending)
        final = step == c.cfg.train.max_steps
        if (self.save_due and c.guard.consecutive == 0) or final:
            if c.members.saves and c.checks.fit_to_save(step):  # the final save too: never a diverged one
                self.save(step)
                c.faults.after_save_started(step)
            schedule.saved(step)  # after a failed replica check too: the next try is an interval later
            self.save_due = False
        elif c.memory.enabled and c.commits.memory_schedule.due(step) and c.guard.consecutive == 0:
            # the members that save (one replica, or every rank), never a copy of diverged replicas
            if c.members.saves and not c.memory.pending and c.checks.fit_to_save(step):
                c.memory.save(step, c.state)
            c.commits.memory_schedule.saved(step)
        excluded = c.stragglers.excluded()
        if leaving or excluded:  # never a diverged save before leaving either: withheld, as any other
            saves = c.members.saves_before_leaving(leaving + len(excluded))
            saved = saves and c.checks.fit_to_save(step)
            if saved and (c.checkpointer.pending is None or c.checkpointer.pending[0] != step):
                self.save(step)
                schedule.saved(step)
            self.ended |= leave(step, excluded, saves, saved, c.members, c.preemption, c.stragglers, c.commits.settle)
