"""The data-parallel training loop, run on every rank. Depends on `torch.distributed`, not on Ray.

Read top to bottom: `train` starts the data pipeline at the committed checkpoint's data position,
builds the model, optimizer, schedule and the checkpointed state, restores, then runs
`Trainer.step` once per optimizer step: this rank's share of the global batch, at any world size
(`data.position.BatchPlan`) -> forward/backward over its `grad_accum_steps` passes -> clip
(global grad norm) -> spike guard (all ranks agree) -> wait for the checkpoint snapshot ->
optimizer step or skip -> LR scheduler -> advance the data position -> held-out validation at its
interval (`validation`) -> rank check and replica fingerprint at their intervals -> roll back
after persistent spikes, else commit/save. Who trains a step, the split, the gradient reduction
across replicas and whether the step counts are the step members' (`replicas`: the whole group
under restart recovery, a torchft quorum of replicas under replica recovery); the loop calls them
the same way in both modes.

The per-step side work runs in step hooks (`raytrain_ft.hooks`), in this order: fault injection
(`faults`), rank 0's goodput ledger (`goodput.StepAccount`: every second of wall time in one
bucket), step metrics and MFU (`step_metrics`), the data audit (`data.audit`), the watchdog beat
(`watchdog`). Fault injection that changes the step's own values (loss multiplier, slowed or
killed checkpoint writes) is called where it acts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from raytrain_ft.checkpoint import Checkpointer, list_step_dirs, peek, restore_latest, step_path
from raytrain_ft.config import Config
from raytrain_ft.data.audit import DataAudit
from raytrain_ft.data.manifest import Manifest, load_manifest
from raytrain_ft.data.order import steps_per_epoch, window_sample_ids
from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.errors import ConfigError, StorageFullError, end_run
from raytrain_ft.faults import FaultInjector
from raytrain_ft.goodput import GoodputLedger, StepAccount
from raytrain_ft.guards import RankChecks, ReplicaMismatchError, RollbackLog, SpikeGuard
from raytrain_ft.hooks import StepHook, StepHooks, StepResult
from raytrain_ft.interval import CheckpointSchedule, planning_mtbf_s
from raytrain_ft.model import lm_loss
from raytrain_ft.parallel import Parallel, build
from raytrain_ft.recovery import failures
from raytrain_ft.replicas import Share, first_share, step_members
from raytrain_ft.schedule import lr_schedule
from raytrain_ft.session import Session
from raytrain_ft.step_metrics import StepMetrics
from raytrain_ft.train_state import (
    KEY_DATA,
    KEY_GOODPUT,
    KEY_GUARDS,
    KEY_META,
    KEY_MODEL,
    KEY_OPTIM,
    KEY_PROGRESS,
    KEY_ROLLBACKS,
    KEY_SCHEDULER,
    ModelState,
    OptimizerState,
    Pickled,
    Progress,
    RNGState,
    RunMeta,
    TrainState,
    rng_key,
    seed_rngs,
)
from raytrain_ft.validation import Validation
from raytrain_ft.watchdog import StepWatchdog

log = logging.getLogger(__name__)


def fingerprint(cfg: Config, manifest: Manifest, num_params: int) -> dict:
    """What must match between a checkpoint and the run resuming it: model shape, data, data order and
    LR schedule (a changed seed would re-permute a half-consumed epoch; a changed max_steps would
    stretch a cosine already half done). To train a wsd run further: `raytrain-ft extend` (raytrain_ft.schedule)."""
    return {
        "model.preset": cfg.model.preset,
        "num_params": num_params,
        "vocab_size": manifest.vocab_size,
        "seq_len": manifest.seq_len,
        "data.fingerprint": manifest.fingerprint,
        "train.global_batch_size": cfg.train.global_batch_size,
        "train.micro_batch_size": cfg.train.micro_batch_size,  # the lanes of the data order
        # the data order and the LR schedule: a resumed run must see the same ones
        "train.seed": cfg.train.seed,
        "train.max_steps": cfg.train.max_steps,
        "train.lr": cfg.train.lr,
        "train.warmup_steps": cfg.train.warmup_steps,
        "train.min_lr_ratio": cfg.train.min_lr_ratio,
        "train.lr_schedule": cfg.train.lr_schedule,
        "train.decay_steps": cfg.train.decay_steps,
    }


def check_data_fits(cfg: Config, manifest: Manifest) -> None:
    """Raises ConfigError when `train.seq_len` disagrees with the dataset or it cannot fill one step."""
    if cfg.train.seq_len not in (0, manifest.seq_len):
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} but the dataset has seq_len {manifest.seq_len}")
    if cfg.train.global_batch_size > manifest.num_samples:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} exceeds the {manifest.num_samples} samples "
            f"of {cfg.data.path}"
        )
    steps_per_epoch(manifest, cfg.train.global_batch_size, cfg.train.micro_batch_size)


def step_batches(
    session: Session, position: DataPosition, plan: BatchPlan, rank: int, steps_per_epoch: int
) -> Iterator[list]:
    """Endless iterator over steps; each item is this rank's `grad_accum_steps` passes (`BatchPlan.passes`)."""
    epoch, start = position.epoch, position.consumed // plan.global_batch_size
    lanes = len(plan.lanes(rank))
    while True:
        micro = session.micro_batches(epoch, start, steps_per_epoch, plan, rank)
        for _ in range(steps_per_epoch - start):
            yield plan.passes(rank, [next(micro) for _ in range(lanes)])
        epoch, start = epoch + 1, 0


def started(batches: Iterator[list]) -> Iterator[list]:
    """`batches`, its first item fetched from now on in a background thread: the data pipeline
    starts (Ray Data: read tasks, their worker processes) while the model builds and loads."""
    fetching = ThreadPoolExecutor(1, thread_name_prefix="first-batch")  # named in stack dumps
    first = fetching.submit(next, batches)
    fetching.shutdown(wait=False)  # the thread ends once the first item is fetched

    def chained() -> Iterator[list]:
        yield first.result()
        yield from batches

    return chained()


class Batches:
    """This rank's passes of each step (`take`), read ahead from one stream while the steps follow
    each other; read again from the data position when a step is not the one the stream is at: the
    split changed (a replica quorum of another size), the position moved (a restore of an older
    checkpoint, a rollback, a heal), or a step did not commit (`Replicas.commit`: the same passes
    are returned again)."""

    def __init__(self, session: Session, steps_per_epoch: int, position: DataPosition, share: Share):
        self.session, self.steps_per_epoch = session, steps_per_epoch
        self.stream = started(step_batches(session, position, share.plan, share.rank, steps_per_epoch))
        self.next_key: tuple = (position.epoch, position.consumed, share)
        self.last_key: tuple | None = None
        self.last: list = []

    def take(self, position: DataPosition, share: Share) -> list:
        """The passes of the step at `position` for `share` (`BatchPlan.passes`)."""
        key = (position.epoch, position.consumed, share)
        if key == self.last_key:
            return self.last
        if key != self.next_key:
            self.stream = step_batches(self.session, position, share.plan, share.rank, self.steps_per_epoch)
        self.last, self.last_key = next(self.stream), key
        after = DataPosition(position.epoch, position.consumed)
        after.advance(share.plan.global_batch_size, self.steps_per_epoch)
        self.next_key = (after.epoch, after.consumed, share)
        return self.last


def forward_backward(par: Parallel, plan: BatchPlan, passes: list[dict], loss_factor: float, device) -> float:
    """Accumulate gradients over this rank's passes (`BatchPlan.passes`), each weighted by
    `BatchPlan.pass_weight`: the gradient of the mean loss over the global batch's G sequences,
    whatever the world size and split. Returns this rank's weighted loss (the ranks' sum over W is
    the global mean loss). A pass without sequences (a rank whose share is shorter than the passes)
    runs the rank's first sequence at weight 0, so every rank runs the same collectives."""
    loss = torch.zeros((), device=device)
    for i, mb in enumerate(passes):
        n = len(mb["tokens"])
        tokens = (mb["tokens"] if n else passes[0]["tokens"][:1]).to(device, non_blocking=True)
        with par.micro_batch(last=i == len(passes) - 1):
            micro_loss = lm_loss(par.module, tokens) * (loss_factor * plan.pass_weight(n))
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
        ConfigError, DataError, CheckpointError: one-line user errors (see `raytrain_ft.errors`).
        ReplicaMismatchError: a guard alert under `guards.on_alert: restart`.
    """
    trainer = Trainer(cfg, session)
    try:
        while trainer.progress.step < cfg.train.max_steps:
            trainer.step()
    except StorageFullError as e:  # every rank, at the same save: end the run instead of restarting
        trainer.watchdog.stop()
        if trainer.rank == 0:
            end_run(session.run_root, str(e))
        return
    trainer.watchdog.stop()  # the final write may take longer than a step
    trainer.finish()
    trainer.members.finish(session.run_root)


class Trainer:
    """One rank's training run: the components, and `step()`."""

    def __init__(self, cfg: Config, session: Session):
        init_started_at = time.time()  # restore time (goodput) counts from here
        self.cfg, self.session = cfg, session
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.logger = session.run_logger(attempt=True) if session.rank == 0 else None
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.manifest = load_manifest(cfg.data.path)
        check_data_fits(cfg, self.manifest)
        self.plan = BatchPlan(cfg.train.global_batch_size, cfg.train.micro_batch_size, self.world_size)
        self.steps_per_epoch = steps_per_epoch(self.manifest, self.plan.global_batch_size, self.plan.micro_batch_size)
        latest, early = session.latest_checkpoint(), DataPosition()
        peek(latest, {KEY_DATA: Pickled(early)})  # read alone from the checkpoint: the data starts flowing now
        self.batches = Batches(
            session, self.steps_per_epoch, early, first_share(cfg, self.plan, self.rank, session.rank)
        )

        shape = self.manifest.vocab_size, self.manifest.seq_len
        self.par, self.optimizer = build(cfg, *shape, self.device, resuming=latest is not None)
        self.scheduler = lr_schedule(self.optimizer, cfg.train)
        self.progress, self.position = Progress(), DataPosition()
        g = cfg.guards.spike
        self.guard, self.rollbacks = SpikeGuard(g.factor, g.window, g.warmup), RollbackLog()
        num_params = sum(p.numel() for p in self.par.model.parameters())

        self.state = TrainState(self.rank)
        self.state.add(KEY_MODEL, ModelState(self.par.model))
        self.state.add(KEY_OPTIM, OptimizerState(self.par.model, self.optimizer))
        self.state.add(KEY_SCHEDULER, Pickled(self.scheduler))
        self.state.add(KEY_PROGRESS, Pickled(self.progress))
        self.state.add(KEY_DATA, Pickled(self.position))
        self.state.add(KEY_GUARDS, Pickled(self.guard))
        self.state.add(KEY_ROLLBACKS, Pickled(self.rollbacks))
        self.state.add(rng_key(self.rank), Pickled(RNGState()))
        self.state.add(KEY_META, RunMeta(fingerprint(cfg, self.manifest, num_params), session.mlflow_run_id))
        self.ledger = GoodputLedger()
        if self.logger:
            self.state.add(KEY_GOODPUT, Pickled(self.ledger))

        self.checkpointer = Checkpointer(session.run_root, self._commit)
        self.group = self.checkpointer.control_group  # CPU gloo group for guard collectives
        self.checks = RankChecks(cfg.guards, self.par, self.group, self.logger, self.settle)
        self.validation = Validation(
            cfg.validation, cfg.data.path, self.manifest, self.plan, self.rank, self.par, self.group, self.device
        )
        self.audit = DataAudit(
            session.run_root, lambda ids: self.members.gather(ids), cfg.data.audit, self.plan.max_share
        )
        self.faults = FaultInjector(
            cfg.faults, self.rank, session.run_root, self.settle, lambda: self.par.local_parameters()[0]
        )
        self.watchdog = StepWatchdog(  # every rank: the hung one reports its stacks
            cfg.failure.hang_timeout_s,
            session.run_root,
            self.rank,
            lambda *hang: session.run_logger(attempt=False).hang(self.rank, *hang),
        )
        # replica recovery: a replacement must not delete the save a live replica is writing
        clean = cfg.failure.recovery == "restart"
        resumed_from, loaded = restore_latest(self.checkpointer, self.state, session, self.logger, clean)
        if rng_key(self.rank) not in loaded:  # fresh start, or a rank added by an elastic resize
            seed_rngs(cfg.train.seed + self.progress.step, self.rank)
        self.watchdog.beat(step_done=False)  # restoring a large checkpoint is neither a hang nor a step
        share = Share(self.plan, self.rank)
        self.members = step_members(
            cfg, share, self.group, self.state, self.progress.step, session.rank, {"audit": self.audit}
        )
        self.save_due = self.preemption_saved = False
        self.done = self.progress.step >= cfg.train.max_steps  # a finished run submitted again
        failure_times = self.start_attempt(init_started_at, resumed_from, KEY_GOODPUT in loaded) if self.logger else []
        self.schedule = self.checkpoint_schedule(failure_times)
        metrics = StepMetrics(
            cfg,
            self.plan,
            self.manifest.seq_len,
            self.par.model,
            self.scheduler,
            self.position,
            self.guard,
            self.logger,
            self.rank,
            first_step=self.progress.step + 1,
        )
        account: list[StepHook] = [StepAccount(self.ledger)] if self.logger else []
        self.hooks = StepHooks([self.faults, *account, metrics, self.audit, self.watchdog])
        log.info(
            "rank %d: start at step %d (world size %d, %d sequences per step in %d passes, batch_balance %.3f)",
            self.rank,
            self.progress.step,
            self.world_size,
            self.plan.share(self.rank),
            self.plan.grad_accum_steps,
            self.plan.batch_balance,
        )

    def start_attempt(self, init_started_at: float, resumed_from: int | None, ledger_loaded: bool) -> list[float]:
        """Rank 0, after the restore: log the attempt, classify the time since the checkpoint's
        snapshot (goodput), and return the run's failure times (unix seconds) so far."""
        assert self.logger is not None  # rank 0 logs
        self.logger.tags(self.par.tags())
        self.logger.metrics(
            self.progress.step,
            {
                "resumed_from_step": resumed_from or 0,
                "world_size": self.world_size,
                "batch_balance": self.plan.batch_balance,
            },
        )
        self.logger.event(
            "attempt_start", resumed_from=resumed_from or 0, world_size=self.world_size, init_started_at=init_started_at
        )
        events = self.logger.events()
        self.logger.timeline.recover(resumed_from or 0, [e["time"] for e in events if e["kind"] == "attempt_start"])
        if not ledger_loaded:
            self.ledger.start(self.logger.run_start())
        if not self.done:  # a finished run's account is closed
            self.ledger.add_gap(events, time.time(), fresh=not ledger_loaded)
            self.logger.goodput(self.progress.step, self.ledger.summary(time.time()))
        return [f["time"] for _, f in failures(events)]

    def checkpoint_schedule(self, failure_times: list[float]) -> CheckpointSchedule:
        """`checkpoint.interval`: fixed, or auto with the MTBF rank 0 chose (broadcast: ranks must agree)."""
        c = self.cfg.checkpoint
        if c.interval != "auto":
            return CheckpointSchedule(c.interval_steps)
        mtbf = torch.zeros(1, dtype=torch.float64)
        if self.rank == 0:
            assert self.logger is not None
            f = self.cfg.failure
            mtbf[0], source = planning_mtbf_s(
                f.mtbf_hours_per_gpu, self.world_size, failure_times, self.ledger.run_start, time.time()
            )
            self.logger.tags({"mtbf_source": source})
        dist.broadcast(mtbf, src=0, group=self.group)
        return CheckpointSchedule(c.interval_steps, mtbf.item(), last_save_step=self.progress.step)

    def _commit(self, step: int, path: str) -> None:
        self.audit.flush()
        self.session.commit(step, path, {"step": step})
        if self.logger:
            self.logger.timeline.committed(step)
        if self.schedule.auto:  # every rank plans with the slowest rank's figures
            cp = self.checkpointer
            measured = torch.tensor([cp.last_cost_s, cp.last_duration_s, self.watchdog.median_step_s])
            dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.group)
            planned = self.schedule.update(*measured.tolist())
            if self.logger and planned:
                self.logger.metrics(step, planned)
        if self.logger:
            self.logger.goodput(step, self.ledger.summary(time.time()))
            self.logger.refresh_loss_plot()

    def finish(self) -> None:
        """After the last step: wait for the final checkpoint; rank 0 logs the goodput summary and plot."""
        self.settle()
        if self.logger and not self.done:
            self.ledger.add("checkpoint_stall", time.time())
            self.logger.goodput(self.progress.step, self.ledger.summary(time.time()), final=True)
            self.logger.refresh_loss_plot(wait=True)

    def step(self) -> None:
        """One optimizer step on every rank (collectives: all ranks call it together). Under replica
        recovery a step that does not commit returns early, its data position unchanged: the next
        call trains the same sequences again (`raytrain_ft.replicas`)."""
        share = self.members.begin()  # who trains this step; a replica behind its peers heals here
        step = self.progress.step + 1
        self.hooks.before_step(step)
        passes = self.batches.take(self.position, share)
        self.hooks.after_batch(step, passes)
        weighted = forward_backward(self.par, share.plan, passes, self.faults.loss_factor(step), self.device)
        local_loss = rank_mean_loss(share.plan, share.rank, weighted)  # what the rank check compares
        weighted = self.members.reduce(self.par, weighted)  # replicas: their gradients averaged, losses summed
        if not self.members.commit():
            self.optimizer.zero_grad(set_to_none=True)
            return
        grad_norm = self.par.clip_grad_norm_(self.cfg.train.grad_clip)
        skip, median = self.guard.decide(grad_norm)
        totals = torch.tensor([weighted, float(skip)], dtype=torch.float64)
        dist.all_reduce(totals, group=self.group)  # SUM: global mean loss, and every rank's decision
        if totals[1].item() not in (0, self.world_size):
            raise ReplicaMismatchError(f"step {step}: ranks disagree on skipping (grad norms differ)")
        self.checkpointer.wait_staged()  # the snapshot must be copied before the weights change
        if not skip:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.progress.step = step
        self.position.advance(self.plan.global_batch_size, self.steps_per_epoch)
        val = self.validation.maybe_run(step)  # every rank (collectives); empty when not due
        loss, stall_s = totals[0].item() / share.plan.world_size, self.checkpointer.take_stall_s()
        self.hooks.after_optimizer_step(
            StepResult(step, loss, grad_norm, skip, median, stall_s, val.metrics, val.seconds)
        )
        self.checks.monitor(step, local_loss, grad_norm)
        if self.guard.consecutive >= self.cfg.guards.spike.max_consecutive_skips:
            self.rollback(step)
        else:
            self.checkpointer.poll()
            self.maybe_save(step)
        self.hooks.after_step(step)

    def maybe_save(self, step: int) -> None:
        """Periodic, final and just-in-time (preemption) saves; none while a skip streak is on."""
        # auto: never start a save while the previous one is still writing (writes must not queue)
        self.save_due |= self.schedule.due(step) and not (self.schedule.auto and self.checkpointer.pending)
        final = step == self.cfg.train.max_steps
        if (self.save_due and self.guard.consecutive == 0) or final:
            if self.members.saves and (self.checks.check_replicas(step) or final):
                self.checkpointer.save(step, self.state, write_delay_s=self.faults.save_delay_s(step))
                self.faults.after_save_started(step)
            self.schedule.saved(step)  # after a failed replica check too: the next try is an interval later
            self.save_due = False
        if not self.preemption_saved and self.session.preemption_pending():
            self.save_before_preemption(step)
            self.preemption_saved = True

    def save_before_preemption(self, step: int) -> None:
        """Just-in-time checkpoint when a node is about to be preempted: save (unless this step's
        periodic save is in flight) and wait until it is registered, so the restart loses nothing."""
        if self.checkpointer.pending is None or self.checkpointer.pending[0] != step:
            self.checkpointer.save(step, self.state)
            self.schedule.saved(step)
        self.settle()
        if self.logger:
            self.logger.event("preemption_checkpoint", step=step)

    def settle(self) -> None:
        """Finish the in-flight save and wait until the runtime registered every commit."""
        self.checkpointer.wait()
        self.session.flush()
        if self.logger:
            self.logger.timeline.registered()

    def rollback(self, step: int) -> None:
        """Persistent spikes: reload the last checkpoint before the streak and skip a data window."""
        self.checkpointer.wait()
        first_bad = step - self.guard.consecutive + 1
        complete = sorted(
            (s for s, ok in list_step_dirs(self.session.run_root).items() if ok and s < first_bad), reverse=True
        )
        if not complete:
            raise ReplicaMismatchError(
                f"{self.guard.consecutive} skipped steps in a row and no checkpoint before step {first_bad}"
            )
        target = step_path(self.session.run_root, complete[0])
        restore_started_at = time.time()
        keep = self.state.components.pop(KEY_ROLLBACKS)  # the rollback record survives the reload
        try:
            self.checkpointer.restore(self.state, [target], lambda path, reason: None)
        finally:
            self.state.add(KEY_ROLLBACKS, keep)
        self.audit.discard_after(self.progress.step)
        if self.logger:
            self.logger.timeline.discard_after(self.progress.step)
        c = self.cfg
        window = c.guards.spike.skip_window_steps
        skipped = window_sample_ids(c.data.path, self.manifest, c.train.seed, self.position, self.plan, window)
        for _ in range(window):
            self.position.advance(self.plan.global_batch_size, self.steps_per_epoch)
        record = {
            "at_step": step,
            "to_step": self.progress.step,
            "skipped_steps": window,
            "skipped_sample_ids": skipped,
        }
        self.rollbacks.rollbacks.append(record)
        self.schedule.saved(self.progress.step)
        log.warning(
            "rank %d: rolled back from step %d to %d, skipping %d global batches",
            self.rank,
            step,
            self.progress.step,
            window,
        )
        if self.logger:  # the reloaded ledger ends at the checkpoint: account for the discarded steps
            self.logger.event("rollback", **record, restore_started_at=restore_started_at)
            self.ledger.add_gap(self.logger.events(), time.time(), fresh=False)
            self.logger.metrics(step, {"rollbacks": len(self.rollbacks.rollbacks)})
