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
share), so the same split stays until a probe sees them fast in k of n steps (recovery).

A rebalanced straggler trains a share no other rank has, where the others' figures bound its cost
only loosely; so its recovery is not judged at the moved split (its steps are `held` from the
detector's count) but at a probe: after `straggler.probe_every_steps` steps of a split, one window
at the even split (`Rebalance`).
"""

from __future__ import annotations

import logging

from raytrain_ft.core.hooks import StepHook, StepResult
from raytrain_ft.data.position import BatchPlan, DataPosition, Share
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
    not `enabled` (`straggler.action` is not `rebalance`). `detector`: the `StragglerMonitor`'s.

    The probe: once a split has been in force `probe_every_steps` steps, the next `detector.window`
    steps train the even split, where a flagged rank is compared with ranks of its own share (no
    cost model); recovered there (fast in `min_slow_steps` of them), the split stays even, else the
    split comes back after the probe. The rebalanced ranks' steps under the split are `held` from
    the detector's recovery count: at a share no other rank has, the others' cost predicts theirs
    only within bounds, and measured at seq_len 128 (2 gloo ranks, one at factor 2 with 8 of 24
    sequences) the other rank's per-sequence figure rose from 3.7 to 5 ms at 16 sequences, so the
    slow rank read recovered at its lower bound and the split moved back and forth every 6 steps.
    A checkpoint taken during a probe holds the even split: a resume judges the rank afresh."""

    def __init__(
        self,
        detector: StragglerDetector,
        position: DataPosition,
        global_batch_size: int,
        enabled: bool,
        probe_every_steps: int,
    ):
        self.detector, self.position, self.g, self.enabled = detector, position, global_batch_size, enabled
        self.probe_every = probe_every_steps
        self.ranks: frozenset[int] | None = None  # the flagged ranks the split in force is for; None: not seeded
        self.moved_at = 0  # the step after which the split in force was set
        self.probe_until: int | None = None  # the last step of the probe in progress

    def before_step(self, step: int) -> None:
        """First step of an attempt: seed the detector with the ranks the restored split is for."""
        if not self.enabled or self.ranks is not None:
            return
        split, even = self.position.split, self.g / max(len(self.position.split), 1)
        for r, n in enumerate(split):
            if n < even:
                self.detector.assume(Straggler(r, even / n, step), step - 1)
        self.ranks, self.moved_at = frozenset(self.detector.flagged), step - 1
        self._hold()

    def after_optimizer_step(self, result: StepResult) -> None:
        """After the detector judged `result`: a changed set of flagged ranks sets the next step's
        split; a split in force `probe_every_steps` steps starts a probe; a probe's end restores it."""
        if not self.enabled:
            return
        flagged, w, step = self.detector.flagged, len(result.compute_s_per_seq), result.step
        speeds = [1 / flagged[r].factor if r in flagged else 1.0 for r in range(w)]
        if frozenset(flagged) != self.ranks or len(self.position.split) not in (0, w):
            self._move(step, proportional_split(self.g, speeds), "")
        elif self.probe_until is not None and step >= self.probe_until:
            self._move(step, proportional_split(self.g, speeds), " (the probe found it still slow)")
        elif self.probe_until is None and self.position.split and step - self.moved_at >= self.probe_every:
            self._move(step, (), " (a probe)")
            self.probe_until = step + self.detector.window
        self._hold()

    def _move(self, step: int, split: tuple[int, ...], why: str) -> None:
        self.position.split, self.ranks = split, frozenset(self.detector.flagged)
        self.moved_at, self.probe_until = step, None
        log.warning("step %d: split from step %d on: %s%s", step, step + 1, split or "even", why)

    def _hold(self) -> None:
        """The detector holds the ranks the split in force moved sequences off."""
        split = self.position.split
        self.detector.held = (
            frozenset(r for r, n in enumerate(split) if n < self.g / len(split)) if split else frozenset()
        )
