"""One rank's run components: everything `loop.Trainer` runs its algorithm with, built before the attempt starts.

`RunComponents(cfg, session)` builds them, on every rank in the same order (the model's wrapping
and the checkpointer's process groups run collectives): who records (`replicas.Role`), the data
(`BatchPlan`, and `Batches` already filling from the committed checkpoint's data position, the one
thing read from the checkpoint now), the model and optimizer (`model.parallel.build`), the LR
schedule, the spike guard and rollback log, the goodput ledger, the train state that checkpoints
them (`checkpoint.train_state.run_state`), the checkpointer and the memory tier
(`checkpoint.memory_tier`), the step members (`raytrain_ft.resilience.step_members`: the whole group
or the torchft replicas; they join once the restore has set the step, `StepMembers.start`), the
data audit, the saves and commits (`raytrain_ft.training.commits`), the rollback, the guards'
cross-member checks, validation, fault injection, the progress beat, the checkpoint schedules,
drain notices, the compute timer, the step hooks in their order (`raytrain_ft.core.hooks`) and the
attempt's record (`telemetry.attempt`). Construction only: nothing is restored. Each component gets
the others it calls as objects (the members, `Commits.settle`), built before it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import torch.distributed as dist

from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.fingerprint import fingerprint
from raytrain_ft.checkpoint.interval import CheckpointSchedule
from raytrain_ft.checkpoint.memory_tier import MemoryTier
from raytrain_ft.checkpoint.reader import peek
from raytrain_ft.checkpoint.train_state import (
    KEY_DATA,
    KEY_GUARDS,
    KEY_PROGRESS,
    KEY_ROLLBACKS,
    KEY_SCHEDULER,
    Pickled,
    Progress,
    RunMeta,
    run_state,
)
from raytrain_ft.core.config import Config
from raytrain_ft.core.hooks import StepHooks
from raytrain_ft.core.recorder import Gated, NullRecorder
from raytrain_ft.core.schedule import lr_schedule
from raytrain_ft.data.audit import DataAudit
from raytrain_ft.data.batches import Batches, check_data_fits
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import steps_per_epoch
from raytrain_ft.data.position import BatchPlan, DataPosition, Share
from raytrain_ft.model.causal_lm import model_id
from raytrain_ft.model.parallel import build
from raytrain_ft.model.pretrained import weights_sha256
from raytrain_ft.resilience.faults import FaultInjector
from raytrain_ft.resilience.guards import RankChecks, RollbackLog, SpikeGuard
from raytrain_ft.resilience.preemption import Preemption
from raytrain_ft.resilience.rebalance import Rebalance, rebalanced
from raytrain_ft.resilience.replicas import Replicas
from raytrain_ft.resilience.rollback import Rollback
from raytrain_ft.resilience.step_members import StepMembers, first_share, role
from raytrain_ft.resilience.straggler import ComputeTimer, StragglerDetector, StragglerMonitor, exclusion
from raytrain_ft.resilience.watchdog import StepBeat
from raytrain_ft.resilience.whole_group import WholeGroup
from raytrain_ft.telemetry.attempt import AttemptRecord
from raytrain_ft.telemetry.goodput import GoodputLedger, StepAccount
from raytrain_ft.telemetry.step_metrics import StepMetrics
from raytrain_ft.training.commits import Commits
from raytrain_ft.training.session import Session
from raytrain_ft.training.validation import Validation


def audit_width(cfg: Config, plan: BatchPlan) -> int:
    """The most sample ids a rank trains per step (`DataAudit`): the even split's largest share, or
    under `straggler.action: rebalance` the largest any split can give (G - W + 1)."""
    if cfg.straggler.action == "rebalance":
        return plan.global_batch_size - plan.world_size + 1
    return plan.max_share


def straggler_hooks(
    cfg: Config, session: Session, position: DataPosition, plan: BatchPlan, members: StepMembers
) -> tuple[StragglerMonitor, Rebalance]:
    """The straggler step hooks sharing one detector (`raytrain_ft.resilience.straggler`): the
    monitor (flags, events, exclusion) and the rebalance (a no-op unless `straggler.action:
    rebalance`) that moves the split in `position`. `members.rank`: this worker's rank in the step's split."""
    st = cfg.straggler
    detector = StragglerDetector(st.threshold, st.window, st.min_slow_steps)
    rebalance = Rebalance(detector, position, plan.global_batch_size, st.action == "rebalance", st.probe_every_steps)
    own = session.recorder(attempt=False)
    monitor = StragglerMonitor(
        detector, st.action, own, members, session.rank, session.node, exclusion(cfg), session.run_root
    )
    return monitor, rebalance


def init_source(folder: str) -> str:
    """`<folder> sha256:<hex>` of a `model.init_from` folder's weights (`weights_sha256`), read by
    rank 0 and given to every rank (the fingerprint is alike on every rank)."""
    found = [f"{folder} sha256:{weights_sha256(folder)}" if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(found, src=0)
    return found[0]


class RunComponents:
    """One rank's run components (module doc), built by the constructor."""

    def __init__(self, cfg: Config, session: Session):
        init_started_at = time.time()  # restore time (goodput) counts from here
        self.cfg, self.session = cfg, session
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # restart recovery: rank 0 records; replica recovery: every replica, each step the step's
        # participant of rank 0 (`step_recorder`), the attempt replica 0 unless it is a replacement
        self.role = role(cfg, session.rank, session.replacement)
        self.recorder = session.recorder(attempt=self.role.attempt) if self.role.records else NullRecorder()
        self.attempt_recorder = self.recorder if self.role.attempt else NullRecorder()
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.manifest = load_manifest(cfg.data.path)
        check_data_fits(cfg, self.manifest)
        self.plan = BatchPlan(cfg.train.global_batch_size, cfg.train.micro_batch_size, self.world_size)
        self.steps_per_epoch = steps_per_epoch(self.manifest, self.plan.global_batch_size, self.plan.micro_batch_size)
        latest, batches_from = session.latest_checkpoint(), DataPosition()
        peek(latest, {KEY_DATA: Pickled(batches_from)})  # read alone from the checkpoint: the data starts now
        share = rebalanced(first_share(cfg, self.plan, self.rank, session.rank), batches_from.split)
        self.batches = Batches(session, self.steps_per_epoch, batches_from, share, cfg.waits.data_timeout_s)

        shape = self.manifest.vocab_size, self.manifest.seq_len
        self.par, self.optimizer = build(cfg, *shape, self.device, resuming=latest is not None)
        self.scheduler = lr_schedule(self.optimizer, cfg.train)
        self.progress, self.position = Progress(), DataPosition()
        g = cfg.guards.spike
        self.guard, self.rollbacks = SpikeGuard(g.factor, g.window, g.warmup), RollbackLog()
        num_params = sum(p.numel() for p in self.par.model.parameters())

        self.ledger = GoodputLedger()  # kept alike on every rank; rank 0's is checkpointed and recorded
        pickled = {KEY_SCHEDULER: self.scheduler, KEY_PROGRESS: self.progress, KEY_DATA: self.position}
        pickled |= {KEY_GUARDS: self.guard, KEY_ROLLBACKS: self.rollbacks}
        fp = fingerprint(cfg, self.manifest, num_params, model_id(cfg.model))
        if cfg.model.init_from and latest is None:  # step 0 of continued pretraining: its source, once
            fp["model.init_from"] = init_source(cfg.model.init_from)
        config: Any = self.par.model.config  # the network's `transformers` config
        meta = RunMeta(fp, session.mlflow_run_id, model_config=json.loads(config.to_json_string()))
        self.state = run_state(
            self.rank, self.par.model, self.optimizer, pickled, meta, self.ledger if self.rank == 0 else None
        )

        self.checkpointer = Checkpointer(session.run_root, cfg.failure.collective_timeout_s)
        self.group = self.checkpointer.control_group  # CPU gloo group for guard collectives
        m = cfg.checkpoint.memory
        keepers = session.memory_keepers(m.dir) if m.enabled else None
        topology = {"world_size": self.world_size, **self.par.tags()}
        self.memory = MemoryTier(keepers, m.peer_copies, self.group, cfg.failure.collective_timeout_s, topology)
        self.members = self.build_members()
        self.step_recorder = Gated(self.recorder, self.members)
        self.audit = DataAudit(session.run_root, self.members.gather, cfg.data.audit, audit_width(cfg, self.plan))
        self.beat = StepBeat(session.beat)  # every rank: the driver's watchdog stops a rank that stalls
        # auto intervals: planned in `Trainer.begin` from the run's failures
        schedules = CheckpointSchedule(cfg.checkpoint.interval_steps), CheckpointSchedule(max(m.interval_steps, 1))
        self.commits = Commits(
            session,
            self.state,
            self.checkpointer,
            self.memory,
            self.recorder,
            self.audit,
            self.ledger,
            self.beat,
            self.group,
            schedules,
        )
        self.roll_back = Rollback(
            cfg,
            self.manifest,
            self.plan,
            self.checkpointer,
            self.state,
            session.run_root,
            session.history,
            self.step_recorder,
            self.ledger.add_gap,
        )
        self.checks = RankChecks(cfg.guards, self.par, self.members, self.step_recorder, self.commits.settle)
        self.validation = Validation(
            cfg.validation, cfg.data.path, self.manifest, self.plan, self.rank, self.par, self.group, self.device
        )
        # a fault's rank is the run's (under replica recovery the replica's)
        self.faults = FaultInjector(cfg.faults, session.rank, session.run_root, self.commits.settle, self.par)
        self.preemption = Preemption(session, session.rank)
        metrics = StepMetrics(
            cfg,
            self.plan,
            self.manifest.seq_len,
            self.par.model,
            self.scheduler,
            self.position,
            self.guard,
            self.step_recorder,
            self.rank,
        )
        self.compute = ComputeTimer(self.par.model, self.device)
        self.stragglers, rebalance = straggler_hooks(cfg, session, self.position, self.plan, self.members)
        hooks = [self.faults, StepAccount(self.ledger), metrics, self.stragglers, rebalance, self.audit, self.beat]
        self.hooks = StepHooks(hooks)
        self.attempt = AttemptRecord(
            self.attempt_recorder, self.ledger, init_started_at, self.world_size, self.plan.batch_balance
        )

    def build_members(self) -> StepMembers:
        """The step members (`raytrain_ft.resilience.step_members`): the whole group
        (`failure.recovery: restart`), or this rank's torchft replica, which joins at `StepMembers.start`."""
        if self.cfg.failure.recovery == "replica":
            return Replicas(self.cfg, self.state, self.session.rank, self.recorder, self.role.replacement)
        return WholeGroup(Share(self.plan, self.rank), self.group)
