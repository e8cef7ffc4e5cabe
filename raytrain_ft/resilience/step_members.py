"""Who trains each step, and whether it counts: the whole group, or the replicas of a torchft quorum.

The loop asks its `StepMembers` five things per optimizer step, whatever the recovery mode:
`begin()` (this step's `Share`: the batch split and this rank's place in it), `reduce(par)` after
the forward/backward passes, `agree(step, loss, skip, may_save, doomed, compute_s)` (an `Agreement`:
the members' summed loss, one spike-guard decision for all of them, whether the fingerprint runs before
a save, how many members' nodes are being drained for preemption, `raytrain_ft.resilience.preemption`, and every
member's straggler figure, `raytrain_ft.resilience.straggler`), `accepted()` (whether the step counts)
before the optimizer step, and `gather(row)` for the data audit and the guards' cross-member checks
(`guards.RankChecks`: the rank-spread check and the replica fingerprint compare the rows of every
member of the step); `saves` and `records` say whether this rank writes the step's checkpoint and
records its metrics, `holds_copies(par)` whether the members hold copies of the same weights (the
fingerprint applies) and `saves_together` whether every member reaches each save (the fingerprint
before a save is a collective there).

Two implementations: `raytrain_ft.resilience.whole_group.WholeGroup` (`failure.recovery: restart`)
and `raytrain_ft.resilience.replicas.Replicas` (`failure.recovery: replica`, a torchft quorum);
`raytrain_ft.training.run_components` builds the one the config names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful

from raytrain_ft.core.config import Config
from raytrain_ft.data.position import BatchPlan, Share
from raytrain_ft.model.parallel import Parallel


class Agreement(NamedTuple):
    """What a step's members agreed on (`agree`): the SUM of their losses, the skip decision, whether
    the fingerprint runs before a save (replicas), how many members hold a drain notice (`leaving`),
    and `figures` (each member's straggler figure, `raytrain_ft.resilience.straggler`: compute seconds per
    sequence, in the split's rank order)."""

    loss_sum: float
    skip: bool
    before_save: bool
    leaving: int
    figures: tuple[float, ...]


def agreed_row(values: list[float], compute_s: float, share: Share) -> torch.Tensor:
    """The float64 row one member adds to the step's agree all-reduce (SUM): `values`, then one slot
    per member of `share.plan`, this member's holding its straggler figure (`compute_s`, its compute
    seconds of the step, per sequence of its share: so an uneven split compares), the others 0
    (exact: x + 0 is x)."""
    row = torch.zeros(len(values) + share.plan.world_size, dtype=torch.float64)
    row[: len(values)] = torch.tensor(values, dtype=torch.float64)
    row[len(values) + share.rank] = compute_s / share.plan.share(share.rank)
    return row


@dataclass(frozen=True)
class Role:
    """What one process records for the run. `attempt`: it starts the run's attempt (a fresh step
    timeline, the `attempt_start` event, the previous attempt's values sorted); `records`: it has
    a recorder (it records a step when `StepMembers.records`); `replacement`: a replica started in
    place of a failed one while the others kept training (it starts no attempt); `cleans`: its
    restore deletes uncommitted step folders (not under replica recovery: a live replica may be
    writing one)."""

    attempt: bool
    records: bool
    replacement: bool
    cleans: bool


def role(cfg: Config, rank: int, replacement: bool) -> Role:
    """Restart recovery: rank 0 records everything. Replica recovery: every replica records the
    steps it is rank 0 of; replica 0 starts the attempt, unless it is a replacement."""
    if cfg.failure.recovery == "replica":
        return Role(attempt=rank == 0 and not replacement, records=True, replacement=replacement, cleans=False)
    return Role(attempt=rank == 0, records=rank == 0, replacement=False, cleans=True)


def first_share(cfg: Config, plan: BatchPlan, rank: int, replica_index: int) -> Share:
    """The share a rank expects before its first step, to start reading data while the model builds:
    `plan` and `rank` (the whole group's); under replica recovery every replica in the quorum."""
    if cfg.failure.recovery == "replica":
        n = cfg.worker_range[1]
        return Share(BatchPlan(cfg.train.global_batch_size, cfg.train.micro_batch_size, n), min(replica_index, n - 1))
    return Share(plan, rank)


class StepMembers(Protocol):
    """Who trains each step (module doc): what the loop, the guards and the leaving rules ask of them."""

    @property
    def saves(self) -> bool:
        """Whether this rank writes this step's durable checkpoint."""
        ...

    @property
    def saves_together(self) -> bool:
        """Whether every member reaches each save (the fingerprint before it is then a collective)."""
        ...

    @property
    def records(self) -> bool:
        """Whether this rank records this step's metrics and events."""
        ...

    @property
    def recovering_s(self) -> float:
        """Seconds of the step spent waiting for a lost peer to be dropped (goodput)."""
        ...

    @property
    def rank(self) -> int:
        """This member's place in the step's split."""
        ...

    def start(self, step: int, heal_also: dict[str, Stateful]) -> None:
        """Start the attempt's steps after the restore set `step`; a heal (replicas) also replaces
        `heal_also`, state no checkpoint holds."""
        ...

    def begin(self) -> Share:
        """This step's split and this member's place in it."""
        ...

    def reduce(self, par: Parallel) -> None:
        """Reduce the step's gradients over the members (after the forward/backward passes)."""
        ...

    def agree(self, step: int, loss: float, skip: bool, may_save: bool, doomed: bool, compute_s: float) -> Agreement:
        """One collective: the members' summed loss, one skip decision, and the rest of `Agreement`."""
        ...

    def saves_before_leaving(self, leaving: int) -> bool:
        """Whether the step is saved before `leaving` members leave."""
        ...

    def leave(self) -> bool:
        """Whether a doomed member leaves now (True) or trains on until its restart (False)."""
        ...

    def exclude(self, ranks: list[int]) -> bool:
        """Whether the attempt ends to exclude the straggler `ranks` after this step."""
        ...

    def accepted(self) -> bool:
        """Whether the step counts (before the optimizer step)."""
        ...

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        """`row` (width,) of every member, stacked: (members, width), same dtype (a collective)."""
        ...

    def holds_copies(self, par: Parallel) -> bool:
        """Whether the members hold copies of the same weights (the replica fingerprint applies)."""
        ...

    def finish(self, run_root: str) -> None:
        """The run ended: leave what the members' end needs in the run folder."""
        ...
