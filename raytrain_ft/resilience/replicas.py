"""`Replicas`, the `StepMembers` of `failure.recovery: replica` (`raytrain_ft.resilience.step_members`):
the replicas of each step's torchft quorum.

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
  4. `accepted()` is `Manager.should_commit`: False when a peer failed during the step (the all-reduce
     errored) or too few replicas took part. The loop then neither steps the optimizer nor
     advances the data position: the step is trained again, same sequences, by the next quorum.
  5. The guards compare across the participants: `gather` is an all-reduce over the quorum's
     replica group, so the rank-spread check sees every participant's [loss, grad norm] and the
     replica fingerprint every participant's weight checksum (each replica holds the full model:
     `holds_copies`). A replica whose weights differ from its peers' (a heal that was not bitwise,
     a flipped bit) raises the same `replica_mismatch` alert on every participant as a DDP rank
     would under restart recovery. The fingerprint runs at `guards.fingerprint.interval_steps` (every
     participant of a committed step, a schedule they share) and before every save: each replica
     plans its saves alone (`saves_together` is False), so the saver announces in `agree` that a
     save may follow the step, every participant then runs the fingerprint after the optimizer
     step, and the saver saves only if that step's fingerprint ran and passed.

  Validation is not split across replicas: each replica evaluates the whole validation set in its
  own group of one (`validation.Validation` with world size 1). That costs P times the compute of a
  split, but needs no collective across replicas after the commit (a peer failing there would leave
  a committed step without its validation, and a split would change with every quorum's size and
  re-read the set); the replicas hold equal weights (the fingerprint checks it), so their val_loss is
  the same value and the step's recording replica records it.

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
import pickle
import time
from datetime import timedelta
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.stateful import Stateful

from raytrain_ft.checkpoint.train_state import KEY_GUARDS, KEY_META, KEY_MODEL, KEY_OPTIM, TrainState
from raytrain_ft.core.config import Config
from raytrain_ft.core.recorder import Recorder
from raytrain_ft.core.run_folder import replica_final_file
from raytrain_ft.core.waits import LIGHTHOUSE_JOIN_S
from raytrain_ft.data.position import BatchPlan, Share
from raytrain_ft.model.parallel import Parallel
from raytrain_ft.resilience.step_members import Agreement, agreed_row
from raytrain_ft.resilience.straggler import StragglerExcluded

log = logging.getLogger(__name__)

# Not sent to a healing replica: the run metadata is the replica's own config's.
NOT_HEALED = (KEY_META,)
# Lighthouse (one per run, started by Ray Train's `TorchftConfig`): a quorum needs one replica; the
# first waits this long for the others to join (start-up skew); a replica silent this long is dead.
# The heartbeat timeout is what the survivors wait after a kill before they train on without the dead
# replica (at 5 s a replacement Ray Train started from an idle worker process had joined by then: a
# test run where the survivor never trained alone). 1 s is 10 of torchft's heartbeats (its Manager's
# `heartbeat_interval`, 100 ms), sent by the Manager's own Rust threads, which a busy Python thread
# does not hold up; 2 s put the survivors' first commit after a kill above 3 s even at 0.2 s steps
# (docs/benchmarks.md, clustered failures).
LIGHTHOUSE = {"min_replicas": 1, "join_timeout_ms": int(LIGHTHOUSE_JOIN_S * 1000), "heartbeat_timeout_ms": 1_000}


class Replicas:
    """`failure.recovery: replica`: the replicas of each step's torchft quorum (module doc).

    Args:
        cfg: the run's config (`train.global_batch_size`, `micro_batch_size`, `scaling.num_workers`).
        state: this replica's train state; its components are what a healing peer receives.
        replica_index: this replica's Ray Train world rank (its torchft replica id, `replica_<i>`).
        recorder: this replica's recorder (its replica events; the loop's step records go through it
            when `records`).
        replacement: Ray Train started this replica in place of a failed one (`Role.replacement`).

    Built before the restore (the loop's components hold it); `start` joins torchft once the restore
    has set the step: a replica heartbeats to the lighthouse only from then on, so no quorum waits
    for one that is still restoring.
    """

    def __init__(
        self, cfg: Config, state: TrainState, replica_index: int, recorder: Recorder, replacement: bool = False
    ):
        self.cfg, self.global_batch_size = cfg, cfg.train.global_batch_size
        self.micro_batch_size = cfg.train.micro_batch_size
        self.state, self.replica_index = state, replica_index
        self.recorder, self.replacement, self.joined = recorder, replacement, False
        self.last_participants: int | None = None  # of this replica's last committed step
        self.lost = False  # this replica's last step did not commit
        self.recovering_s = 0.0
        self.share: Share | None = None

    def start(self, step: int, heal_also: dict[str, Stateful]) -> None:
        """Join torchft at `step` (the progress step after the restore: the Manager's step).
        `heal_also`: what a healing peer receives besides the train state and no checkpoint holds
        (the data audit's buffered steps: those trained before this replica joined are written by
        whichever replica commits next)."""
        from torchft import Manager, ProcessGroupGloo  # the `[ft]` extra: imported only in this mode

        self.healed = {k: c for k, c in self.state.components.items() if k not in NOT_HEALED} | heal_also
        timeout = timedelta(seconds=self.cfg.waits.quorum_timeout_s)  # collectives, quorum, commit, heal transfers
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
            replica_id=f"replica_{self.replica_index}",
            init_sync=False,  # every replica initialises or restores the same weights
        )
        self.manager.register_state_dict_fn("train", self._load, self._state_dict)
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        if self.replacement:
            self.recorder.event("replica_start", replica=self.replica_index, resumed_from=step)

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
        started = time.monotonic()
        self.manager.start_quorum()
        waited = time.monotonic() - started
        rank = self.manager.participating_rank()
        assert rank is not None, "a synchronous quorum makes every member a participant"
        participants = self.manager.num_participants()
        shrank = self.last_participants is not None and participants < self.last_participants
        # the survivors' wait for the lighthouse to drop a dead peer (its heartbeat timeout)
        self.recovering_s = waited if self.lost or shrank else 0.0
        plan = BatchPlan(self.global_batch_size, self.micro_batch_size, participants)
        self.share = Share(plan, rank)
        return self.share

    @property
    def rank(self) -> int:
        """This replica's place in the step's split: its rank among the quorum's participants."""
        assert self.share is not None, "rank after begin()"
        return self.share.rank

    @property
    def saves(self) -> bool:
        """Whether this replica writes this step's durable checkpoint: the participant of rank 0."""
        return self.share is not None and self.share.rank == 0

    @property
    def records(self) -> bool:
        """Whether this replica records this step's metrics and events: the participant of rank 0."""
        return self.saves

    def reduce(self, par: Parallel) -> None:
        """Average the gradients over the step's participants in place. After a failed all-reduce
        the values are garbage and `accepted()` is False."""
        grads = [p.grad for p in par.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()  # AVG: sum over the participants, divided by P
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def agree(self, step: int, loss: float, skip: bool, may_save: bool, doomed: bool, compute_s: float) -> Agreement:
        """(the participants' `loss` summed, whether any participant's guard skips the step, whether
        the step's saver may save after it, how many participants' nodes are drained, every
        participant's straggler figure from its `compute_s`, `agreed_row`): one all-reduce, before the
        acceptance (a failed one makes `accepted()` False). `may_save`: this replica saves (`saves`) and a
        save may follow the step; when the saver's is True every participant runs the fingerprint after
        the optimizer step (`RankChecks.monitor`), so the saver's weights are compared with its peers'
        just before it saves them (`RankChecks.fit_to_save`). `doomed`: this replica's node is drained
        (`raytrain_ft.resilience.preemption`)."""
        assert self.share is not None, "agree after begin()"
        totals = agreed_row([loss, float(skip), float(may_save), float(doomed)], compute_s, self.share)
        self.manager.allreduce(totals, reduce_op=dist.ReduceOp.SUM).wait()
        votes = totals[1].item()
        if votes != float(skip) * self.manager.num_participants() and votes > 0:
            log.warning(
                "replica %d: step %d: %g of the replicas' guards skip it: every replica skips",
                self.replica_index,
                step,
                votes,
            )
        return Agreement(
            totals[0].item(), votes > 0, totals[2].item() > 0, int(totals[3].item()), tuple(totals[4:].tolist())
        )

    def saves_before_leaving(self, leaving: int) -> bool:
        """Whether this replica writes a checkpoint of the step after a drain notice: the step's saver,
        when every participant is leaving (else the survivors hold the step in memory)."""
        assert self.share is not None, "after begin()"
        return self.saves and leaving >= self.share.plan.world_size

    def leave(self) -> bool:
        """A doomed replica leaves the quorum at this step boundary (it stops its Manager: the
        lighthouse drops it after its heartbeat timeout and the others' next quorum forms without
        it). True: the caller then waits for its node's end (`preemption.wait_out`)."""
        self.manager.shutdown(wait=False)
        return True

    def exclude(self, ranks: list[int]) -> bool:
        """`ranks` are stragglers excluded after this step (`straggler.Exclusion`): an excluded
        replica leaves the quorum at this step boundary, as a doomed one does, and ends (Ray Train
        replaces it, in its placement-group bundle: on the same node while that node lives,
        docs/stragglers.md); the others train on. False for those.

        Raises:
            StragglerExcluded: this replica is excluded.
        """
        if self.rank not in ranks:
            return False
        self.leave()
        raise StragglerExcluded(f"replica {self.replica_index} excluded as a straggler; Ray Train replaces it")

    def accepted(self) -> bool:
        """Whether the step counts (`Manager.should_commit`); False: train it again (a
        `step_not_committed` event). A replacement's first committed step: a `replica_joined` event."""
        participants = self.manager.num_participants()
        if not self.manager.should_commit():
            self.lost = True
            step = self.manager.current_step() + 1
            self.recorder.event("step_not_committed", replica=self.replica_index, step=step, participants=participants)
            return False
        self.lost, self.last_participants = False, participants
        if self.replacement and not self.joined:
            step = self.manager.current_step()
            self.recorder.event("replica_joined", replica=self.replica_index, step=step, participants=participants)
            self.recorder.write_recovery_tables()
        self.joined = True
        return True

    saves_together = False  # the step's rank 0 saves alone, on its own schedule (module doc)

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        """`row` (width,) int64 or float64 of every participant, stacked by participant rank:
        (P, width). An all-reduce SUM over the quorum (the Manager has no all-gather): each
        participant fills its own row, zeros elsewhere (exact: x + 0 is x). When the all-reduce
        fails (a peer died; the Manager is errored until the next quorum) only this participant's
        row is known: (1, width), so a check compares nothing instead of zeros (a step whose audit
        gather fails does not commit and is recorded again)."""
        assert self.share is not None, "gather after begin()"
        rows = torch.zeros((self.share.plan.world_size, len(row)), dtype=row.dtype)
        rows[self.share.rank] = row
        self.manager.allreduce(rows, reduce_op=dist.ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            log.warning("replica %d: a gather across the replicas failed: only this replica's row", self.replica_index)
            return row[None].clone()
        return rows

    def holds_copies(self, par: Parallel) -> bool:
        """True: every replica holds the full model (one worker per replica group)."""
        return True

    def finish(self, run_root: str) -> None:
        """After the last step: record this replica's `state_digest` of its model and optimizer in
        `<run folder>/workers/replica<i>.final.json` with its step and its spike guard's count of
        skipped steps (that every replica ended equal is checked from these files), then leave the quorum."""
        tensors = {**self.state.components[KEY_MODEL].state_dict(), **flat_optimizer_state(self.state)}
        guard = pickle.loads(self.state.components[KEY_GUARDS].state_dict()["pickle"])
        record = {"step": self.manager.current_step(), "digest": state_digest(tensors), "skipped": guard["skipped"]}
        with fsspec.open(replica_final_file(run_root, self.replica_index), "w", auto_mkdir=True) as f:
            json.dump(record, f)
        self.manager.shutdown(wait=False)


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
