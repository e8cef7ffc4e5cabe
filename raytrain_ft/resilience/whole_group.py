"""`WholeGroup`, the `StepMembers` of `failure.recovery: restart` (`raytrain_ft.resilience.step_members`):
every rank of the process group trains every step with the same split; the strategy (DDP, FSDP)
already reduced the gradients; the ranks' guard decisions must be equal (they judge the same
gradients: a disagreement raises `SkipDisagreementError`); every step is accepted.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from raytrain_ft.data.position import Share
from raytrain_ft.model.parallel import Parallel
from raytrain_ft.resilience.guards import SkipDisagreementError
from raytrain_ft.resilience.step_members import Agreement, agreed_row


class WholeGroup:
    """`failure.recovery: restart`: every rank of the process group, every step (module doc)."""

    saves = True  # every rank writes its part of each checkpoint
    saves_together = True  # every rank reaches each save: the fingerprint before it is a collective
    records = True  # rank 0's recorder records (the others' is a `NullRecorder`)
    recovering_s = 0.0  # a failure restarts the group: nothing of a step is lost to it while training

    def __init__(self, share: Share, group: dist.ProcessGroup):
        self.share, self.group = share, group

    def start(self, step: int, heal_also: dict[str, Stateful]) -> None:
        """Nothing to join: the process group is the members."""

    def begin(self) -> Share:
        return self.share

    @property
    def rank(self) -> int:
        """This rank's place in the step's split."""
        return self.share.rank

    def reduce(self, par: Parallel) -> None:
        """The strategy reduced the gradients in backward."""

    def agree(self, step: int, loss: float, skip: bool, may_save: bool, doomed: bool, compute_s: float) -> Agreement:
        """(every rank's `loss` summed, the skip decision, False, the ranks whose node is drained, every
        rank's straggler figure from its `compute_s`, `agreed_row`) over the group (one all-reduce).
        The fingerprint before a save needs no signal here: every rank reaches each save (`saves_together`).

        Raises:
            SkipDisagreementError: the ranks' guards decided differently (their grad norms differ).
        """
        totals = agreed_row([loss, float(skip), float(doomed)], compute_s, self.share)
        dist.all_reduce(totals, group=self.group)
        if totals[1].item() not in (0, dist.get_world_size(self.group)):
            raise SkipDisagreementError(f"step {step}: ranks disagree on skipping (grad norms differ)")
        return Agreement(totals[0].item(), skip, False, int(totals[2].item()), tuple(totals[3:].tolist()))

    def saves_before_leaving(self, leaving: int) -> bool:
        """Every rank saves the step after a drain notice: Ray Train restarts the whole group at the
        deadline, from the last registered checkpoint."""
        return True

    def leave(self) -> bool:
        """False: a doomed rank trains on with the group until Ray Train restarts it."""
        return False

    def exclude(self, ranks: list[int]) -> bool:
        """`ranks` are stragglers excluded after this step (`straggler.Exclusion`, which leaves at
        least the range's minimum): True, every rank ends the attempt once the step is saved and
        registered (the driver restarts the group without their nodes, `launch.driver`)."""
        return True

    def accepted(self) -> bool:
        """True: the whole group trains every step (a failed rank fails the attempt)."""
        return True

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        """`row` (width,) of every rank, stacked: (world size, width), same dtype (a collective)."""
        gathered = [torch.empty_like(row) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(gathered, row, group=self.group)
        return torch.stack(gathered)

    def holds_copies(self, par: Parallel) -> bool:
        """Whether ranks hold copies of the same weights: ddp, hsdp (each shard across replica groups)."""
        return par.has_replicas

    def finish(self, run_root: str) -> None:
        pass
