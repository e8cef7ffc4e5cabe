"""Stragglers: find the rank whose own work is slow, without mistaking a wait for slowness.

A slow GPU (thermal throttling, a degraded link, a noisy neighbour) errors nowhere: every synchronous
step waits for it in the gradient all-reduce. Three parts, each rank running all of them:

* `ComputeTimer`: this rank's compute time of a step, excluding its waits in collectives. It runs
  from the start of the step's forward/backward passes to the moment its last gradient is ready
  (a post-accumulate-grad hook on every parameter): under DDP the gradient all-reduce of the last
  pass overlaps the backward and the pass's `backward()` returns only once every rank's buckets are
  reduced, so the time after the last gradient is the wait for the slowest rank, and a fast rank's
  figure does not include it; the earlier passes run under `no_sync` (no collective), and DDP does
  not broadcast buffers in forward (`raytrain_ft.model.parallel.build`). Under replica recovery the
  reduction runs after the passes (`Replicas.reduce`). Under fsdp/hsdp the passes all-gather and
  reduce-scatter per layer, so every rank's figure includes its waits for the slowest: ranks look
  alike and none is flagged (a limit, not a false flag). Wall clock on CPU; CUDA events on GPU
  (the host enqueues ahead of the device).
* Each rank's figure per sequence (its compute over its share of the global batch) is summed into
  the step's agree all-reduce (`StepMembers.agree`: each member fills its own slot), so every member
  holds every member's figure without a collective of its own.
* What is compared (`slowness`, `predicted_s`): each member's compute seconds of the step against
  what the other members' figures predict for its share, under the cost model `a + b x share`
  (a: the fixed cost of the step's passes, the same on every rank since every rank runs the same
  passes, `BatchPlan.grad_accum_steps`; b: per sequence). Measured (the tiny model, seq_len 32, one
  thread, forward + backward of one pass): 3.6-7.4 ms for 1 to 8 sequences, so nearly all of it is
  per pass (a), and per sequence alone the 2-sequence rank of a 2/3/3 split measured 1.68x the
  others (a false flag); at seq_len 128, 5.7 ms for 1 and 26 ms for 8 sequences (b dominates, as
  on a large model). Neither per step nor per sequence is right for both, so: a member whose share
  some others share is compared with their median (same passes, same sequences, no model); with
  two or more distinct shares among the others a and b are fitted; a member alone in its share with
  one other share among the rest gets the model's upper bound at its share (`predicted_s`), so
  its ratio is never above its true slowness: an uneven split is never a straggler, and a slow
  member with a lone share is seen at between 1 and share/theirs (or theirs/share) of its slowness,
  the price of not knowing a and b.
* `StragglerDetector` (pure, the same decision on every rank): a member is slow at a step when its
  compute exceeds `threshold` x that prediction; it is flagged when slow in
  `min_slow_steps` (k) of the last `window` (n) steps, and recovered when fast in k of the steps
  after its flag, fast judged against the others' lower-bound prediction (`StragglerDetector`).

Defaults (`raytrain_ft.core.config.StragglerSection`: threshold 1.5, k = 6 of n = 10), from measured
runs of the tests' tiny model (a few milliseconds of compute per sequence) at 3 ranks on the 2-core
development machine while six other jobs shared it (load average 30-80): in the 10 healthy steps
before a factor-2 `slow` fault the ratio of a rank's figure to the others' median reached 4.6, and
5 of the 30 values exceeded 1.5 (the OS descheduling a rank for a step, up to three steps in a
row); the factor-2 rank's median ratio was 1.7 and it was flagged 8 steps after its first slow step
(tests/test_stragglers.py). 1.5 sits below the factor 2 the issue names; k = 6 of 10 needs a rank
slow in most of the window, so bursts of three are not flagged. Healthy-run percentiles, false
flags and detection delay of longer runs: `benchmarks/stragglers.py` (docs/benchmarks.md). On GPUs
(compute of tens of milliseconds per step, no oversubscription) the noise is far smaller.

`Exclusion` (`straggler.action: exclude`, pure, the same decision on every member): a member still
flagged `exclude_after_steps` steps after its flag leaves at that step boundary, unless the members
would fall below their minimum. The default 30 confirms a flag over three more windows before a
restart is spent on it: from the healthy-noise tail of benchmarks/stragglers.py's 2,000-step runs,
about 3e-15 wrongful exclusions per rank-step where 10 gave about 2e-8 (docs/stragglers.md).
What leaving means per recovery mode is the step members'
(`replicas.WholeGroup.exclude`, `replicas.Replicas.exclude`) and the driver's (docs/stragglers.md).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from raytrain_ft.core.config import Config
from raytrain_ft.core.hooks import StepHook, StepResult
from raytrain_ft.core.recorder import Recorder
from raytrain_ft.core.run_folder import record_exclusion

log = logging.getLogger(__name__)


class ComputeTimer:
    """This rank's compute seconds of a step, its waits in collectives excluded (module doc).

    `with timer:` around the step's forward/backward passes; `timer.seconds` afterwards (0.0 before
    the first step). Hooks every parameter of `model` (`register_post_accumulate_grad_hook`)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.started = self.ready = 0.0
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.ready_event = torch.cuda.Event(enable_timing=True)
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, _: torch.Tensor) -> None:
        if self.cuda:
            self.ready_event.record()
        else:
            self.ready = time.perf_counter()

    def __enter__(self) -> ComputeTimer:
        if self.cuda:
            self.start_event.record()
        self.started = self.ready = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:  # the passes' loss.item() synchronised: both events have completed
            self.seconds = self.start_event.elapsed_time(self.ready_event) / 1000.0
        else:  # no gradient hook fired (no parameter trained): the passes' wall time
            self.seconds = (self.ready if self.ready > self.started else time.perf_counter()) - self.started


def predicted_s(others: Sequence[tuple[int, float]], share: int, bound: str = "upper") -> float:
    """Compute seconds the `others` (`(share, seconds)` of the other members of the step, every one
    running the same passes) predict for a member of `share` sequences, under the cost model
    `seconds = a + b x share` (a >= 0: the fixed cost of the step's passes, the same on every member;
    b >= 0: per sequence); see the module doc. With two or more distinct shares among the others, a
    and b are fitted (least squares through the median of each share); with one, the model is not
    identifiable and the prediction is the model's `bound` at `share`: "upper" (their median when
    shares are equal; `median x max(1, share / theirs)` otherwise: the ratio to it never exceeds the
    true slowness, for flagging) or "lower" (`median x min(1, share / theirs)`: the ratio to it never
    falls below the true slowness, for recovery). 0.0 when the others measured nothing."""
    by_share: dict[int, list[float]] = {}
    for n, t in others:
        by_share.setdefault(n, []).append(t)
    points = sorted((n, statistics.median(ts)) for n, ts in by_share.items())
    if not points:
        return 0.0
    if len(points) == 1:
        n0, t0 = points[0]
        return t0 * (max if bound == "upper" else min)(1.0, share / n0)
    mean_n = statistics.fmean(n for n, _ in points)
    mean_t = statistics.fmean(t for _, t in points)
    b = sum((n - mean_n) * (t - mean_t) for n, t in points) / sum((n - mean_n) ** 2 for n, _ in points)
    b = min(max(b, 0.0), mean_t / mean_n)  # a, b >= 0
    return mean_t - b * mean_n + b * share


def slowness(
    per_sequence_s: Sequence[float],
    shares: Sequence[int] = (),
    bound: str = "upper",
    flagged: Collection[int] = (),
) -> list[float]:
    """Each member's compute seconds of the step over what the other members' figures predict for
    its share (`predicted_s` at `bound`); `per_sequence_s` and `shares` (sequences per member,
    default all equal) in the split's rank order. 1.0 alone or when the others measured nothing.

    The figures of the `flagged` members (known stragglers) predict nobody's cost while any other
    member is left: a slow member's figure is not the cost of a healthy one, and fitted into the
    cost model at its (rebalanced, smaller) share it flattens the slope and lowers the prediction
    for a larger share. Measured: at 4 ranks with rank 1 rebalanced to (4, 2, 3, 3), healthy rank
    0 at its lone share of 4 read 1.63 and was flagged (benchmarks/stragglers.py, simulated device);
    under a cost per sequence its ratio to the others' prediction is at most 4/3 with the slow
    figure in the fit and at most 1 without it."""
    shares = list(shares) or [1] * len(per_sequence_s)
    step_s = [t * n for t, n in zip(per_sequence_s, shares, strict=True)]
    pairs = list(zip(shares, step_s, strict=True))
    out = []
    for r, t in enumerate(step_s):
        others = [p for i, p in enumerate(pairs) if i != r]
        others = [p for i, p in enumerate(pairs) if i != r and i not in flagged] or others
        predicted = predicted_s(others, shares[r], bound)
        out.append(t / predicted if predicted > 0 else 1.0)
    return out


@dataclass(frozen=True)
class Straggler:
    """A flagged member: its `rank` in the step's split, its `factor` (compute per sequence over the
    others' median, the mean of its slow steps in the window) and `first_step` (its first slow step
    in the window that flagged it)."""

    rank: int
    factor: float
    first_step: int


class StragglerDetector:
    """Flags members slow in `min_slow_steps` (k) of the last `window` (n) steps, and recovers a
    flagged member when fast in k of the steps judged after its flag (module doc); pure.

    Slow: its compute over the others' upper-bound prediction for its share exceeds `threshold`
    (`slowness(bound="upper")`: an uneven split is never a straggler). Fast, for recovery: its
    compute over their lower-bound prediction is at most `threshold` (`bound="lower"`): a rebalanced
    straggler trains a share no other member has, and where the cost is per sequence a balanced
    split makes it take as long as the others; judged at the upper bound it would read as
    recovered, the split would move back and it would be flagged again k steps later. The price:
    where the cost is per pass (a small model), a recovered member at a smaller share still reads
    slow and keeps its smaller share, which on such a model costs the others little (their extra
    sequences are the cheap part). Only steps after the flag count, so a flag from k slow steps of
    n is not undone by the n - k fast ones before it, and the steps of the ranks in `held` (set
    before a step by `Rebalance`: ranks training a share moved off them) do not count: their
    recovery is judged at the even split of a probe.

    Raises:
        ValueError: not 1 <= min_slow_steps <= window, or threshold <= 1.
    """

    def __init__(self, threshold: float, window: int, min_slow_steps: int):
        if not 1 <= min_slow_steps <= window or not threshold > 1:
            raise ValueError(f"need threshold > 1 and 1 <= min_slow_steps ({min_slow_steps}) <= window ({window})")
        self.threshold, self.window, self.min_slow = threshold, window, min_slow_steps
        # (step, slowness per member at the upper bound, at the lower bound, the ranks held at it)
        self.judged: deque[tuple[int, list[float], list[float], frozenset[int]]] = deque(maxlen=window)
        self.held: frozenset[int] = frozenset()  # ranks whose next steps do not count for recovery
        self.flagged: dict[int, Straggler] = {}
        self.flagged_at: dict[int, int] = {}  # rank -> the step it was flagged at (or assumed from)

    def assume(self, straggler: Straggler, step: int) -> None:
        """Treat `straggler` as flagged from `step` on (a resume with a split in force: `Rebalance`)."""
        self.flagged[straggler.rank], self.flagged_at[straggler.rank] = straggler, step

    def observe(
        self, step: int, per_sequence_s: Sequence[float], shares: Sequence[int] = ()
    ) -> tuple[list[Straggler], list[Straggler]]:
        """Judge one step's figures (seconds per sequence, one per member, in the split's rank
        order; `shares`: each member's sequences, `slowness`); return (members flagged at this
        step, flagged members recovered at this step). A change of the members' count starts the
        judgement afresh (ranks are renumbered)."""
        if self.judged and len(self.judged[-1][1]) != len(per_sequence_s):
            self.judged.clear()
            self.flagged.clear()
            self.flagged_at.clear()
        upper, lower = (slowness(per_sequence_s, shares, bound, self.flagged) for bound in ("upper", "lower"))
        self.judged.append((step, upper, lower, self.held))
        flagged, recovered = [], []
        for r in range(len(per_sequence_s)):
            if r not in self.flagged:
                slow = [(s, x[r]) for s, x, _, _ in self.judged if x[r] > self.threshold]
                if len(slow) >= self.min_slow:
                    self.assume(Straggler(r, statistics.fmean(x for _, x in slow), slow[0][0]), step)
                    flagged.append(self.flagged[r])
            elif self._fast_since_flag(r) >= self.min_slow:
                del self.flagged_at[r]
                recovered.append(self.flagged.pop(r))
        return flagged, recovered

    def _fast_since_flag(self, r: int) -> int:
        """Steps judged after `r`'s flag, not held, at which `r` was fast (at the lower bound)."""
        return sum(s > self.flagged_at[r] and r not in held and y[r] <= self.threshold for s, _, y, held in self.judged)


class StragglerExcluded(RuntimeError):
    """This replica was excluded as a straggler (`Replicas.exclude`): it ends so that Ray Train replaces it."""


class Exclusion:
    """`straggler.action: exclude`: which flagged members leave at a step (pure; module doc).

    `judge(step, members, flagged, recovered)` after each step's `StragglerDetector.observe`
    (`flagged`, `recovered`: its output; `members`: the step's member count) returns the members to
    exclude after that step: those flagged at a step <= step - `after_steps` and not recovered since,
    in rank order, at most `members - min_members` of them (the others stay flagged and are judged
    again at the next step). A change of the members' count starts afresh, as the detector does.

    Raises:
        ValueError: after_steps < 0 or min_members < 1.
    """

    def __init__(self, after_steps: int, min_members: int):
        if after_steps < 0 or min_members < 1:
            raise ValueError(f"need after_steps ({after_steps}) >= 0 and min_members ({min_members}) >= 1")
        self.after_steps, self.min_members = after_steps, min_members
        self.members = 0
        self.flagged_at: dict[int, tuple[int, Straggler]] = {}  # rank -> (step it was flagged, its flag)

    def judge(
        self, step: int, members: int, flagged: Sequence[Straggler], recovered: Sequence[Straggler]
    ) -> list[Straggler]:
        if members != self.members:
            self.members = members
            self.flagged_at.clear()
        for s in flagged:
            self.flagged_at[s.rank] = (step, s)
        for s in recovered:
            self.flagged_at.pop(s.rank, None)
        due = [s for r, (at, s) in sorted(self.flagged_at.items()) if step - at >= self.after_steps]
        return due[: max(members - self.min_members, 0)]


def exclusion(cfg: Config) -> Exclusion | None:
    """The `Exclusion` of `straggler.action: exclude` (None for another action): at least the
    range's minimum of `scaling.num_workers` stays under restart recovery (the next group must fit
    it), one replica under replica recovery."""
    if cfg.straggler.action != "exclude":
        return None
    least = 1 if cfg.failure.recovery == "replica" else cfg.worker_range[0]
    return Exclusion(cfg.straggler.exclude_after_steps, least)


class Member(Protocol):
    """This worker's place in the step's split (`StepMembers.rank`)."""

    @property
    def rank(self) -> int: ...


class StragglerMonitor(StepHook):
    """The step hook (`raytrain_ft.core.hooks`) that judges each committed step's figures
    (`StepResult.compute_s_per_seq`; `step_metrics` logs them). A flagged member records a
    `straggler` event itself (`own_recorder`: its run rank, node, factor, first step, the action
    taken) and a recovered one `straggler_recovered`; every rank logs a warning. `member.rank`:
    this worker's rank in the step's split (the loop's `StepMembers`); `run_rank`: its rank in the run (`Session.rank`).

    With an `exclusion` (`straggler.action: exclude`) the flag's action is `warn` (a warning is
    all it takes then), `excluded()` lists the members `Exclusion.judge` excludes after the last
    step, and `record_exclusion(step)` records this worker's own exclusion: a second `straggler`
    event with `action: exclude` (`step`: the step after which it leaves, `flagged_step`, and its
    node, rank, factor, first step) and the run folder's record the driver restarts without
    (`run_folder.record_exclusion`, in `run_root`)."""

    def __init__(
        self,
        detector: StragglerDetector,
        action: str,
        own_recorder: Recorder,
        member: Member,
        run_rank: int,
        node: str,
        exclusion: Exclusion | None = None,
        run_root: str = "",
    ):
        self.detector, self.action, self.own = detector, action, own_recorder
        self.member, self.run_rank, self.node = member, run_rank, node
        self.exclusion, self.run_root = exclusion, run_root
        self.due: list[Straggler] = []

    def excluded(self) -> list[int]:
        """The split ranks of the members excluded after the last step ([] without an exclusion)."""
        return [s.rank for s in self.due]

    def record_exclusion(self, step: int) -> None:
        """This worker's `straggler` event with `action: exclude` and its run-folder record (class doc)."""
        assert self.exclusion is not None
        flagged_step, s = self.exclusion.flagged_at[self.member.rank]
        record = {"time": time.time(), "node": self.node, "rank": self.run_rank, "step": step}
        log.warning("step %d: rank %d (node %s) excluded as a straggler", step, self.run_rank, self.node)
        self.own.event(
            "straggler",
            **record,
            factor=round(s.factor, 3),
            first_step=s.first_step,
            flagged_step=flagged_step,
            action="exclude",
        )
        record_exclusion(self.run_root, record)

    def after_optimizer_step(self, result: StepResult) -> None:
        flagged, recovered = self.detector.observe(result.step, result.compute_s_per_seq, result.shares)
        if self.exclusion is not None:
            self.due = self.exclusion.judge(result.step, len(result.compute_s_per_seq), flagged, recovered)
        for s in flagged:
            log.warning(
                "step %d: rank %d is a straggler (x%.2f since step %d)", result.step, s.rank, s.factor, s.first_step
            )
        for s in recovered:
            log.warning("step %d: rank %d is no longer a straggler", result.step, s.rank)
        me = self.member.rank
        for s in flagged:
            if s.rank == me:
                self.own.event(
                    "straggler",
                    step=result.step,
                    rank=self.run_rank,
                    node=self.node,
                    factor=round(s.factor, 3),
                    first_step=s.first_step,
                    action="warn" if self.exclusion is not None else self.action,
                )
        for s in recovered:
            if s.rank == me:
                self.own.event("straggler_recovered", step=result.step, rank=self.run_rank, node=self.node)
