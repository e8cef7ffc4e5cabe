"""Rebalance: move sequences off a flagged straggler with the uneven split (`straggler.action: rebalance`).

The run's math is the split's (`raytrain_ft.data.position`): any split of the step's G sequences over
the W ranks trains the same G sequences in the same lane order, and the loop weighs a pass of n
sequences by `n x W / G`, so the gradient is the mean loss's over the G sequences whatever the
shares. Rebalancing changes only which rank trains which sequences: the sample ids of every step,
the mean loss and the gradient (up to the order of the float sums: a sequence's contribution is
summed on another rank, then all-reduced) are those of the run without the straggler.

The decision (`proportional_split`): each rank's speed is 1 over its `Straggler.factor` (flagged) or
1; its share is G in proportion to speed (largest remainder, at least one sequence each), so a
factor-2 straggler at G=12 over 3 ranks trains 2 and the others 5 (a perfect split would be
2.4/4.8/4.8). No flagged rank: the even rule (`DataPosition.split` empty).

When (`Rebalance`, a step hook after `StragglerMonitor`): at a step where the detector's set of
flagged ranks changed (a flag, a recovery), the new split is written into the data position; the
next step trains it. The detector runs the same decision on every rank from the agreed figures, so
every rank changes its split at the same step boundary, and the split is checkpointed with the data
position. After a resume with a split in force the detector's window is empty (it is not
checkpointed: timing); the ranks the split favours against are seeded as flagged (factor from their
share), so the same split stays until the detector sees them fast in k of n steps (recovery).

A rebalanced straggler trains a share no other rank has: its recovery is judged against the lower
bound of the others' cost at its share (`StragglerDetector`), so a balanced split (where the cost is
per sequence it then takes as long as the others) does not read as recovered; where the cost is per
pass, a recovered rank keeps its smaller share, a limit that costs the others only their extra
sequences' cheap part.
"""

from __future__ import annotations

import logging

from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.hooks import StepHook, StepResult
from raytrain_ft.resilience.replicas import Share
from raytrain_ft.resilience.straggler import Straggler, StragglerDetector

log = logging.getLogger(__name__)


def proportional_split(global_batch_size: int, speeds: list[float]) -> tuple[int, ...]:
    """Shares of `global_batch_size` in proportion to `speeds` (one per rank, > 0): largest remainder
    (ties to the lower rank), each share at least 1 (taken from the largest). Empty when all speeds
    are equal (the even rule).

    Raises:
        ValueError: fewer sequences than ranks, or a speed <= 0.
    """
    g, w = global_batch_size, len(speeds)
    if g < w or min(speeds) <= 0:
        raise ValueError(f"cannot split {g} sequences over speeds {speeds}")
    if len(set(speeds)) == 1:
        return ()
    quotas = [g * s / sum(speeds) for s in speeds]
    shares = [max(1, int(q)) for q in quotas]
    by_remainder = sorted(range(w), key=lambda r: (-(quotas[r] - int(quotas[r])), r))
    for r in by_remainder[: max(g - sum(shares), 0)]:
        shares[r] += 1
    while sum(shares) > g:  # a share raised to 1: taken from the largest
        shares[shares.index(max(shares))] -= 1
    return tuple(shares)


def rebalanced(share: Share, split: tuple[int, ...]) -> Share:
    """`share` with the split in force (`DataPosition.split`); unchanged when the split is empty or
    for another world size (a replica quorum or an elastic resize changed the members)."""
    plan = share.plan
    if len(split) != plan.world_size:
        return share
    return Share(BatchPlan(plan.global_batch_size, plan.micro_batch_size, plan.world_size, split), share.rank)


class Rebalance(StepHook):
    """Keeps `position.split` in proportion to the flagged ranks' speed (module doc); a no-op when
    not `enabled` (`straggler.action` is not `rebalance`). `detector`: the `StragglerMonitor`'s."""

    def __init__(self, detector: StragglerDetector, position: DataPosition, global_batch_size: int, enabled: bool):
        self.detector, self.position, self.g, self.enabled = detector, position, global_batch_size, enabled
        self.ranks: frozenset[int] | None = None  # the flagged ranks the split in force is for; None: not seeded

    def before_step(self, step: int) -> None:
        """First step of an attempt: seed the detector with the ranks the restored split is for."""
        if not self.enabled or self.ranks is not None:
            return
        split, even = self.position.split, self.g / max(len(self.position.split), 1)
        for r, n in enumerate(split):
            if n < even:
                self.detector.assume(Straggler(r, even / n, step), step - 1)
        self.ranks = frozenset(self.detector.flagged)

    def after_optimizer_step(self, result: StepResult) -> None:
        """After the detector judged `result`: a changed set of flagged ranks sets the next step's split."""
        flagged, w = self.detector.flagged, len(result.compute_s_per_seq)
        if not self.enabled or (frozenset(flagged) == self.ranks and len(self.position.split) in (0, w)):
            return
        speeds = [1 / flagged[r].factor if r in flagged else 1.0 for r in range(w)]
        self.position.split, self.ranks = proportional_split(self.g, speeds), frozenset(flagged)
        log.warning("step %d: split from step %d on: %s", result.step, result.step + 1, self.position.split or "even")
