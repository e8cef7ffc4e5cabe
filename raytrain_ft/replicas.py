"""Who trains each step, and whether it counts: the whole group, or the replicas of a torchft quorum.

The loop asks its `StepMembers` four things per optimizer step, whatever the recovery mode:
`begin()` (this step's `Share`: the batch split and this rank's place in it), `reduce(par, loss)`
after the forward/backward passes, `commit()` before the optimizer step, and `gather(ids)` for the
data audit. Two implementations:

* `WholeGroup` (`failure.recovery: restart`): every rank of the process group trains every step
  with the same split; the strategy (DDP, FSDP) already reduced the gradients; every step commits.
* `Replicas` (`failure.recovery: replica`): every Ray Train worker is a replica group of one worker
  holding the full model (Ray Train 2.60 hard-codes `replica_group_size=1`), and a torchft
  `Manager` joins the replicas per step:

  1. **A synchronous quorum before the data is read** (`Manager.start_quorum` with
     `use_async_quorum=False`): the replicas in it, P of them, and this replica's rank among them
     are known before the batch is chosen. A replica behind the quorum's step (a replacement Ray
     Train started after a failure) heals inside the quorum: a live peer sends its whole train
     state (weights, AdamW state, LR schedule, step, data position, RNG, guard state: every
     `TrainState` component but the run metadata and the goodput ledger) over torchft's HTTP
     transport and the replica loads it, through the state-dict callbacks registered here.
  2. The step's global batch of G sequences is dealt over the P participants with the
     any-world-size split (`BatchPlan(G, m, P)`), so a step with fewer replicas still trains the
     whole global batch.
  3. `reduce`: the gradients (every parameter's, flattened into one buffer) are summed over the
     participants and divided by P. The loop weighs a pass of n sequences by `n x P / G`
     (`BatchPlan.pass_weight`), so the result is the sum of the G sequences' loss gradients divided
     by G: the mean over the global batch, at any P. Every participant gets the same bits back
     (one all-reduce), so the replicas stay bitwise equal. The loss is summed alike.
  4. `commit` is `Manager.should_commit`: False when a peer failed during the step (the all-reduce
     errored) or too few replicas took part. The loop then neither steps the optimizer nor
     advances the data position: the step is trained again, same sequences, by the next quorum.

  The Manager's own state (its step) is the progress step: set from it after a restore, carried
  by the heal; it is not a separate checkpoint component.

Durable checkpoints under `replica`: the participant of rank 0 at a save step writes it alone (the
others skip the save: `saves`), into its own process group of one, and commits it through the run
folder's commit marker (`raytrain_ft.launch.worker.ReplicaSession`), never through
`ray.train.report`: a report is a barrier over every Ray Train worker, and a survivor blocked in it
while its replacement waits in the torchft quorum deadlocks (measured: the survivor blocked 34.7 s
in the report barrier, the replacement's quorum timed out at 30 s). No step of the loop waits on a
replica other than through the quorum and its all-reduces.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.stateful import Stateful

from raytrain_ft.config import Config
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.parallel import Parallel
from raytrain_ft.train_state import KEY_GOODPUT, KEY_META, KEY_MODEL, KEY_OPTIM, TrainState

log = logging.getLogger(__name__)

# Not sent to a healing replica: the run metadata is the replica's own config's, the goodput ledger
# is the logging replica's alone.
NOT_HEALED = (KEY_META, KEY_GOODPUT)
# Lighthouse (one per run, started by Ray Train's `TorchftConfig`): a quorum needs one replica; the
# first waits this long for the others to join (start-up skew); a replica silent this long is dead.
# The heartbeat timeout is what the survivors wait after a kill before they train on without the dead
# replica: at 5 s a replacement Ray Train started from an idle worker process had joined by then
# (a test run where the survivor never trained alone); 2 s is well under a replacement's start.
LIGHTHOUSE = {"min_replicas": 1, "join_timeout_ms": 10_000, "heartbeat_timeout_ms": 2_000}
TIMEOUT_S = 60  # Manager collectives, commit and heal transfers


@dataclass(frozen=True)
class Share:
    """One step's batch split and this rank's place in it (`plan.span(rank)` are its sequences)."""

    plan: BatchPlan
    rank: int


class WholeGroup:
    """`failure.recovery: restart`: every rank of the process group, every step (module doc)."""

    saves = True  # every rank writes its part of each checkpoint

    def __init__(self, share: Share, group: dist.ProcessGroup):
        self.share, self.group = share, group

    def begin(self) -> Share:
        return self.share

    def reduce(self, par: Parallel, loss: float) -> float:
        """The strategy reduced the gradients in backward; `loss` stays this rank's."""
        return loss

    def commit(self) -> bool:
        return True

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (width,) of every rank, stacked: (world size, width), same dtype (a collective)."""
        gathered = [torch.empty_like(ids) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, ids, group=self.group)
        return torch.stack(gathered)

    def finish(self, run_root: str) -> None:
        pass


class Replicas:
    """`failure.recovery: replica`: the replicas of each step's torchft quorum (module doc).

    Args:
        cfg: the run's config (`train.global_batch_size`, `micro_batch_size`, `scaling.num_workers`).
        state: this replica's train state; its components are what a healing peer receives.
        replica_index: this replica's Ray Train world rank (its torchft replica id, `replica_<i>`).
        step: the progress step after the restore (the Manager's step).
        heal_only: what a healing peer receives besides `state` and no checkpoint holds (the data
            audit's buffered steps: those trained before this replica joined are written by
            whichever replica commits next).
    """

    def __init__(self, cfg: Config, state: TrainState, replica_index: int, step: int, heal_only: dict[str, Stateful]):
        from torchft import Manager, ProcessGroupGloo  # the `[ft]` extra: imported only in this mode

        self.global_batch_size, self.micro_batch_size = cfg.train.global_batch_size, cfg.train.micro_batch_size
        self.state, self.replica_index = state, replica_index
        self.healed = {k: c for k, c in state.components.items() if k not in NOT_HEALED} | heal_only
        timeout = timedelta(seconds=TIMEOUT_S)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            use_async_quorum=False,  # the quorum (and a heal) completes before the batch is read
            timeout=timeout,
            quorum_timeout=timeout,
            rank=0,
            world_size=1,  # one worker per replica group (Ray Train 2.60)
            replica_id=f"replica_{replica_index}",
            init_sync=False,  # every replica initialises or restores the same weights
        )
        self.manager.register_state_dict_fn("train", self._load, self._state_dict)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self.share: Share | None = None

    def _state_dict(self) -> dict[str, Any]:
        return {k: c.state_dict() for k, c in self.healed.items()}

    def _load(self, healed: dict[str, Any]) -> None:
        for key, value in healed.items():
            self.healed[key].load_state_dict(value)
        log.warning("replica %d: healed from a live peer", self.replica_index)

    def begin(self) -> Share:
        """Join this step's quorum (heal first when behind); return the step's split over its participants.

        Raises:
            RuntimeError: from torchft, when no quorum forms within the Manager's timeout.
        """
        self.manager.start_quorum()
        rank = self.manager.participating_rank()
        assert rank is not None, "a synchronous quorum makes every member a participant"
        plan = BatchPlan(self.global_batch_size, self.micro_batch_size, self.manager.num_participants())
        self.share = Share(plan, rank)
        return self.share

    @property
    def saves(self) -> bool:
        """Whether this replica writes this step's durable checkpoint: the participant of rank 0."""
        return self.share is not None and self.share.rank == 0

    def reduce(self, par: Parallel, loss: float) -> float:
        """Average the gradients over the step's participants in place; return the participants'
        summed `loss`. After a failed all-reduce the values are garbage and `commit()` is False."""
        grads = [p.grad for p in par.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()  # AVG: sum over the participants, divided by P
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        total = torch.tensor([loss], dtype=torch.float64)
        self.manager.allreduce(total, reduce_op=dist.ReduceOp.SUM).wait()
        return total.item()

    def commit(self) -> bool:
        """Whether the step counts (`Manager.should_commit`); False: train it again."""
        return self.manager.should_commit()

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (width,) int64 of every participant, stacked by participant rank: (P, width). An
        all-reduce (the Manager has no all-gather): each participant fills its own row, zeros elsewhere."""
        assert self.share is not None, "gather after begin()"
        rows = torch.zeros((self.share.plan.world_size, len(ids)), dtype=ids.dtype)
        rows[self.share.rank] = ids
        self.manager.allreduce(rows, reduce_op=dist.ReduceOp.SUM).wait()
        return rows

    def finish(self, run_root: str) -> None:
        """After the last step: record this replica's `state_digest` of its model and optimizer in
        `<run folder>/workers/replica<i>.final.json` (that every replica ended equal is checked from
        these files), then leave the quorum."""
        tensors = {**self.state.components[KEY_MODEL].state_dict(), **flat_optimizer_state(self.state)}
        record = {"step": self.manager.current_step(), "digest": state_digest(tensors)}
        with fsspec.open(
            f"{run_root.rstrip('/')}/workers/replica{self.replica_index}.final.json", "w", auto_mkdir=True
        ) as f:
            json.dump(record, f)
        self.manager.shutdown(wait=False)


StepMembers = WholeGroup | Replicas


def flat_optimizer_state(state: TrainState) -> dict[str, torch.Tensor]:
    """The optimizer's tensors keyed as a checkpoint flattens them: `optim.state.<param>.<name>`."""
    saved = state.components[KEY_OPTIM].state_dict()["state"]
    return {f"{KEY_OPTIM}.state.{fqn}.{name}": t for fqn, entries in saved.items() for name, t in entries.items()}


def state_digest(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """{key: xxh64 hex digest of the tensor's dtype, shape and bytes}: equal digests, equal tensors
    (bar a 64-bit hash collision), without moving the tensors between processes."""
    out = {}
    for key, t in sorted(tensors.items()):
        h = xxhash.xxh64(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        out[key] = h.hexdigest()
    return out


def first_share(cfg: Config, plan: BatchPlan, rank: int, replica_index: int) -> Share:
    """The share a rank expects before its first step, to start reading data while the model builds:
    `plan` and `rank` (the whole group's); under replica recovery every replica in the quorum."""
    if cfg.failure.recovery == "replica":
        n = cfg.worker_range[1]
        return Share(BatchPlan(cfg.train.global_batch_size, cfg.train.micro_batch_size, n), min(replica_index, n - 1))
    return Share(plan, rank)


def step_members(
    cfg: Config,
    share: Share,
    group: dist.ProcessGroup,
    state: TrainState,
    step: int,
    replica_index: int,
    heal_only: dict[str, Stateful],
) -> StepMembers:
    """The `StepMembers` of `cfg.failure.recovery`. `share`: the whole group's fixed split (restart);
    `group`: the CPU group the whole group gathers on; `state`, `step`, `heal_only`: what a heal
    replaces (`Replicas`), and its step; `replica_index`: this worker's rank in the run (`Session.rank`)."""
    if cfg.failure.recovery == "replica":
        return Replicas(cfg, state, replica_index, step, heal_only)
    return WholeGroup(share, group)
