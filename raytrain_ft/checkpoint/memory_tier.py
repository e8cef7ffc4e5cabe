"""The memory tier: each rank's train state in its node's memory, a copy on another node; restarts restore from RAM.

Beside the durable checkpoints (`raytrain_ft.checkpoint.checkpointer`, in object storage, committed through
Ray), `checkpoint.memory` keeps frequent checkpoints where a restart reads them in seconds (the field's
"local checkpointing": NVIDIA's resiliency extension, Orbax's emergency checkpoints, GKE's multi-tier
checkpoints; docs/memory-tier.md):

1. Save (`save`, every `checkpoint.memory.interval_steps`, or Young/Daly's interval from the tier's own
   measured cost under `interval: auto`): every rank writes its own self-contained copy of its whole
   train state (the same components and checksums as a durable checkpoint, its own shards only) with
   `dcp.async_save` over a process group of that rank alone, into its node's folder
   (`raytrain_ft.checkpoint.memory_copies`). The snapshot is the durable save's staging (the same stager,
   `wait_staged` before the optimizer step): training stalls no longer than that. On the write
   thread, after the local copy's checksums are written, the copy goes to the keepers of
   `peer_copies` other nodes (`memory_copies.peers`, chosen at each save), each writing and verifying it.
2. Commit (`poll`, every step, one small all-reduce): once every rank's write and peer copies are done,
   the ranks agree (all-reduce MIN) that every copy is in place and verified; only then each rank marks
   its copies `COMMITTED`. A copy not verified everywhere (a peer lost meanwhile, a failed write) makes
   the step not count, on every rank: it is recorded (`memory_checkpoint_not_committed`) and never used.
3. Restore (`restore`, at an attempt's start, before the durable restore): rank 0 asks every live
   node's keeper what it holds and chooses the newest step every rank can be served from, never older
   than the durable checkpoint Ray committed (`memory_copies.plan_restore`); each rank loads its copy
   from its own node, else fetches a peer's, each byte verified as it is read. A copy of another
   topology (world size, strategy) is skipped and recorded; a corrupt one is recorded
   (`corrupt_checkpoint`) and the next source tried; when any rank has none left, every rank falls
   back to the durable checkpoint. Copies newer than the step restored are discarded (`discard_after`:
   they belong to a trajectory the run no longer follows), as after a rollback.

Under replica recovery (`raytrain_ft.resilience.replicas`) every replica is a process group of one
holding the whole state, so the same code keeps one run-wide copy: the step's saver (the participant of
rank 0, as for durable saves) writes it as rank 0, its peers are other replicas' nodes (nodes with a
live keeper), and every replica Ray Train starts, on a restart of all of them or as a replacement,
plans and loads alone from what the keepers hold. A replacement beside live replicas then heals from
them in its first quorum (their step is newer); one that finds no live peer (every replica lost, seen
by Ray Train as several replacements) trains on from the copy instead of the durable checkpoint. Only
the replica that starts the attempt deletes newer copies (`abandon_after`'s `discard`), never a
replacement: a live saver may be writing one.

Off (`interval_steps: 0` and `interval: fixed`, or no keepers: a run without Ray) every method is a no-op.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from raytrain_ft.checkpoint.checkpointer import Checkpointer, WriterFactory
from raytrain_ft.checkpoint.integrity import ChecksummedWriter
from raytrain_ft.checkpoint.memory_copies import Keepers, RestorePlan, copy_path, peers, plan_restore
from raytrain_ft.checkpoint.train_state import TrainState
from raytrain_ft.core.errors import CheckpointError

log = logging.getLogger(__name__)

MEMORY, PEER, STORAGE = "memory", "peer", "storage"  # where an attempt restored from (`restored_from`)


class _ReplicatingWriter(ChecksummedWriter):
    """The local copy's writer; once its checksums are written (`finish`, on the write thread), it sends
    the copy to the peer nodes' keepers and keeps how many verified it (`replicated`)."""

    def __init__(self, path: str, replicate: Callable[[], int]):
        super().__init__(path)
        self.replicate, self.replicated = replicate, -1

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        try:
            self.replicated = self.replicate()
        except Exception as e:  # a peer lost while replicating: the step will not count
            log.warning("peer copy failed: %s", e)


class _CopyWriter(Checkpointer):
    """A `Checkpointer` of this rank's own copies: saves over `own_group` (this rank alone), each copy
    sent on by `replicate(step)` (returns how many peers verified it) once written, no free-space
    check (`raytrain-ft check` bounds the tier), and a write that fails is a copy that does not count,
    not a failed attempt (`poll_written`)."""

    def __init__(
        self,
        root: str,
        timeout_s: float,
        own_group: dist.ProcessGroup,
        control_group: dist.ProcessGroup,
        replicate: Callable[[int], int],
    ):
        super().__init__(root, timeout_s, own_group, control_group)
        self.replicate = replicate
        self.copying: _ReplicatingWriter | None = None

    def _writer(self, path: str, step: int, writer: WriterFactory) -> ChecksummedWriter:
        self.copying = _ReplicatingWriter(path, lambda: self.replicate(step))
        return self.copying

    def check_space(self, step: int) -> None:
        return

    def poll_written(self) -> tuple[int, bool, int] | None:
        """(step, written, peers that verified it) once every rank's write of the pending copy finished,
        else None (a collective)."""
        step = self.pending[0] if self.pending else None
        copying = self.copying
        try:
            done = self.poll()
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            log.warning("memory checkpoint step-%s failed: %s", step, e)
            self.pending = None
            return (step, False, 0) if step is not None else None
        if done is None:
            return None
        return done, True, copying.replicated if copying is not None else 0


class MemoryTier:
    """One rank's side of the memory tier (module doc).

    Args:
        keepers: the nodes' keepers (`Session.memory_keepers`); None: the tier is off.
        peer_copies: `checkpoint.memory.peer_copies`.
        control_group: the durable checkpointer's control group (agreements; CPU gloo).
        timeout_s: `failure.collective_timeout_s`, the bound of its saves' waits.
        topology: {"world_size", "strategy"} of this attempt, recorded with each copy.
    """

    def __init__(
        self,
        keepers: Keepers | None,
        peer_copies: int,
        control_group: dist.ProcessGroup,
        timeout_s: float,
        topology: dict,
    ):
        self.keepers, self.peer_copies, self.group, self.topology = keepers, peer_copies, control_group, topology
        self.rank = dist.get_rank()
        self.group_nodes: list[str] = [keepers.node] if keepers is not None else []  # each rank's (`plan`)
        self.peer_nodes: list[str] = []  # the nodes of the copy in flight's peer copies
        self.writer: _CopyWriter | None = None
        if keepers is not None:
            # a group of this rank alone per rank (every rank creates every one, in the same order)
            own, _ = dist.new_subgroups(group_size=1, backend="gloo", timeout=timedelta(seconds=timeout_s))
            root = os.path.join(keepers.node_dir, f"rank-{self.rank}")
            replicate = lambda step: keepers.replicate(self.rank, step, self.peer_nodes)  # noqa: E731
            self.writer = _CopyWriter(root, timeout_s, own, control_group, replicate)

    @property
    def enabled(self) -> bool:
        return self.writer is not None

    @property
    def pending(self) -> bool:
        return self.writer is not None and self.writer.pending is not None

    # -- save and commit -------------------------------------------------------------------------

    def save(self, step: int, state: TrainState) -> None:
        """Start this rank's copy of `step` (every saving rank) and choose its peers (`memory_copies.peers`:
        the group's nodes, else other nodes with a live keeper); at most one in flight: while one is, no
        new one starts."""
        if self.writer is None or self.keepers is None or self.writer.pending is not None:
            return
        short = len(set(self.group_nodes)) <= self.peer_copies  # the group alone spans too few other nodes
        others = self.keepers.nodes() if short else []
        self.peer_nodes = peers(self.group_nodes, self.keepers.node, self.peer_copies, others)
        self.writer.save(step, state)

    def wait_staged(self) -> None:
        """Block until the snapshot copy is finished (before anything mutates the state)."""
        if self.writer is not None:
            self.writer.wait_staged()

    def take_stall_s(self) -> float:
        """Seconds training was blocked on memory checkpoints since the previous call."""
        return self.writer.take_stall_s() if self.writer is not None else 0.0

    def poll(self) -> tuple[int, bool] | None:
        """(step, committed) once every rank's copy of the pending save and its peer copies are done
        (a collective on every rank; None while not): committed when every rank's copies are in place
        and verified, each rank's then marked `COMMITTED` on its node and its peers'."""
        if self.writer is None:
            return None
        written = self.writer.poll_written()
        if written is None:
            return None
        step, ok, copies = written
        agreed = torch.tensor([int(ok and copies == len(self.peer_nodes))], dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
        if agreed.item() != 1:
            return step, False
        assert self.keepers is not None
        self.keepers.commit(self.rank, step, self.peer_nodes, self.topology)
        return step, True

    def wait(self) -> tuple[int, bool] | None:
        """Finish the copy in flight, if any, on every rank, then as `poll` (a collective)."""
        if self.writer is None or self.writer.pending is None:
            return None
        while (done := self.poll()) is None:
            time.sleep(0.01)
        return done

    @property
    def last_cost_s(self) -> float:
        """The last committed copy's stall, seconds (`checkpoint.interval.agreed_update` reads it)."""
        return self.writer.last_cost_s if self.writer is not None else 0.0

    @property
    def last_duration_s(self) -> float:
        """The last copy's start to written everywhere (peer copies included), seconds."""
        return self.writer.last_duration_s if self.writer is not None else 0.0

    # -- restore ---------------------------------------------------------------------------------

    def plan(self, durable_step: int) -> RestorePlan:
        """Learn where the group's ranks run (the ring of this attempt's peer copies) and the restore plan
        rank 0 chose (`memory_copies.plan_restore`); collectives on every rank."""
        assert self.keepers is not None
        nodes: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(nodes, self.keepers.node, group=self.group)
        self.group_nodes = nodes
        chosen: list[RestorePlan | None] = [None]
        if self.rank == 0:
            chosen[0] = plan_restore(self.keepers.inventory(), nodes, durable_step, self.topology)
        dist.broadcast_object_list(chosen, src=0, group=self.group)
        assert chosen[0] is not None
        return chosen[0]

    def restore(
        self,
        state: TrainState,
        durable_step: int,
        on_corrupt: Callable[[str, str], None],
        on_skip: Callable[[str], None],
    ) -> tuple[int, set[str], str] | None:
        """Load the newest memory checkpoint every rank can be served from, if it is at least
        `durable_step` (a collective on every rank).

        Every copy passed over is reported: another topology through `on_skip(line)` (rank 0), a corrupt
        or unreachable one through `on_corrupt(path, reason)`.

        Returns: (step, the state keys loaded, `MEMORY` when every rank read its own node's copy, else
        `PEER`), or None when the durable checkpoint must be loaded (tier off, nothing usable, or some
        rank could load none of its sources: then `state` may be partly loaded, and the durable restore
        loads every component).
        """
        if self.writer is None or self.keepers is None:
            return None
        plan = self.plan(durable_step)
        for line in plan.skipped:
            on_skip(line)
        if plan.step is None:
            return None
        loaded = self._load_own(state, plan.step, plan.sources[self.rank], on_corrupt)
        tiers: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(tiers, loaded[1] if loaded else None, group=self.group)
        if None in tiers or loaded is None:
            return None
        return plan.step, loaded[0], PEER if PEER in tiers else MEMORY

    def _load_own(
        self, state: TrainState, step: int, sources: list[str], on_corrupt: Callable[[str, str], None]
    ) -> tuple[set[str], str] | None:
        """This rank's copy of `step` from the first of `sources` (nodes) that loads: (keys, tier)."""
        assert self.writer is not None and self.keepers is not None
        for node in sources:
            own = node == self.keepers.node
            try:
                path = (
                    copy_path(self.keepers.node_dir, self.rank, step)
                    if own
                    else self.keepers.fetch(node, self.rank, step)
                )
            except (TimeoutError, OSError) as e:
                on_corrupt(f"node {node}: rank {self.rank} step-{step}", f"unreachable: {e}")
                continue
            try:
                _, keys = self.writer.restore(state, [path], on_corrupt)
            except CheckpointError:  # `on_corrupt` recorded why
                continue
            return keys, MEMORY if own else PEER
        return None

    def abandon_after(self, step: int, discard: bool) -> None:
        """After a restore or a rollback to `step` (every rank): the copy in flight, if any, is finished
        and never counts, and where `discard` (one member: the loop picks it) every node's copies newer
        than `step` are deleted (a trajectory the run no longer follows: a later restart must not return
        to it)."""
        if self.writer is None or self.keepers is None:
            return
        if self.writer.pending is not None:
            try:
                self.writer.wait()
            except (Exception, CheckpointException):  # CheckpointException is a BaseException
                self.writer.pending = None
        if discard:
            self.keepers.discard_after(step)
