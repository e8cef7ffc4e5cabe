"""Guards against silent failure. Every decision is identical on every rank.

* `SpikeGuard` ("skip abnormal batches"): after clipping, a step whose global grad
  norm is non-finite, or above `factor x median(last `window` accepted norms)` once `warmup`
  norms exist, is skipped: gradients zeroed, no optimizer step. The step counter, the LR
  scheduler and the data position still advance (the batch is consumed; the schedule stays a
  function of the step, as Megatron does for skipped iterations). The history is checkpointed.
  After `max_consecutive_skips` skips in a row the loop rolls back (see `loop.rollback`).
* `rank_spread` ("a cheap silent-error detector"): relative spread
  `(max - min) / (|mean| + 1e-9)` of each column of the gathered [loss, grad_norm] rows.
* `replica_checksum`: replicas must hold bitwise-identical weights; the checksum is the int64
  sum of the raw bits of every parameter this rank holds, so any single flipped bit changes it.
  Under DDP every rank is a replica; under HSDP the ranks holding the same shard index (one per
  replica group) are compared (`replica_mismatch`); under FSDP there are no replicas and the check
  does not apply (see `raytrain_ft.model.parallel`).
* `RankChecks`: the loop's rank check and replica fingerprint at their intervals, and their alerts,
  over the step's members (`raytrain_ft.resilience.step_members`' `StepMembers.gather`): every rank of the process
  group under restart recovery; the participants of the step's torchft quorum under replica
  recovery, where every replica holds the full model and the fingerprint compares the replicas.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from raytrain_ft.core.config import GuardsSection

if TYPE_CHECKING:
    from raytrain_ft.core.recorder import Recorder
    from raytrain_ft.model.parallel import Parallel

log = logging.getLogger(__name__)


class GuardError(RuntimeError):
    """A guard ended the attempt: Ray restarts the worker group from the last checkpoint. Every
    cause has its own subclass; a handler of any guard stop catches this base."""


class ReplicaMismatchError(GuardError):
    """Two replicas of one shard hold different weights (`replica_mismatch`), under `guards.on_alert: restart`."""


class RankSpreadError(GuardError):
    """The ranks' loss or grad norm spread beyond `guards.rank_check.max_spread` (`rank_spread`),
    under `guards.on_alert: restart`."""


class SkipDisagreementError(GuardError):
    """The ranks reached different spike-guard decisions for one step (their grad norms differ)."""


class NoRollbackTargetError(GuardError):
    """`guards.spike.max_consecutive_skips` skips in a row and no complete checkpoint before the streak."""


ALERT_ERRORS: dict[str, type[GuardError]] = {"rank_spread": RankSpreadError, "replica_mismatch": ReplicaMismatchError}


@dataclass
class SpikeGuard:
    factor: float = 10.0
    window: int = 100
    warmup: int = 100
    history: deque = field(default_factory=deque)  # accepted grad norms, newest last
    consecutive: int = 0  # skips in a row
    skipped: int = 0  # skips in the whole run

    def decide(self, grad_norm: float) -> tuple[bool, float | None]:
        """Return (skip, median of the history) and update the history/counters (`judge`, then `record`).

        `grad_norm` must be the same float on every rank (it is: DDP all-reduces the gradients
        before `clip_grad_norm_`), so the decision is too.
        """
        skip, median = self.judge(grad_norm)
        self.record(grad_norm, skip)
        return skip, median

    def judge(self, grad_norm: float) -> tuple[bool, float | None]:
        """(skip, median of the history) for `grad_norm`, without changing the guard: the loop agrees
        on the decision across the step's members before the step commits, then `record`s it."""
        median = statistics.median(self.history) if self.history else None
        spike = median is not None and len(self.history) >= self.warmup and grad_norm > self.factor * median
        return not math.isfinite(grad_norm) or spike, median

    def record(self, grad_norm: float, skip: bool) -> None:
        """Count a skip, or add an accepted `grad_norm` to the history."""
        if skip:
            self.consecutive += 1
            self.skipped += 1
            return
        self.consecutive = 0
        self.history.append(grad_norm)
        while len(self.history) > self.window:
            self.history.popleft()

    def state_dict(self) -> dict:
        return {"history": list(self.history), "consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"])
        self.consecutive, self.skipped = int(state["consecutive"]), int(state["skipped"])


@dataclass
class RollbackLog:
    """Rollbacks done so far and the sample positions they skipped (kept across rollbacks)."""

    rollbacks: list[dict] = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"rollbacks": list(self.rollbacks)}

    def load_state_dict(self, state: dict) -> None:
        self.rollbacks = list(state["rollbacks"])


class Members(Protocol):
    """What `RankChecks` needs of the step's members (`raytrain_ft.resilience.step_members.StepMembers`)."""

    @property
    def saves_together(self) -> bool:
        """Whether every member reaches each save."""
        ...

    def gather(self, row: torch.Tensor) -> torch.Tensor:
        """`row` (width,) of every member, stacked: (members, width) (a collective)."""
        ...

    def holds_copies(self, par: Parallel) -> bool:
        """Whether members hold copies of the same weights (the replica fingerprint applies)."""
        ...


def rank_spread(rows: torch.Tensor) -> torch.Tensor:
    """Relative spread per column of a (world_size, k) float tensor -> (k,) float tensor."""
    return (rows.max(0).values - rows.min(0).values) / (rows.mean(0).abs() + 1e-9)


def replica_mismatch(rows: torch.Tensor) -> bool:
    """True when two ranks holding the same shard disagree.

    Args:
        rows: int64 (world_size, 2), one `[shard_index, checksum]` row per rank.
    """
    return any(len(set(rows[rows[:, 0] == s, 1].tolist())) > 1 for s in rows[:, 0].unique().tolist())


def spread_alert(rows: torch.Tensor, max_spread: float) -> dict | None:
    """The `rank_spread` alert's detail, or None when every column's spread is at most `max_spread`.

    Args:
        rows: float64 (world_size, 2), one `[local loss, grad norm]` row per member (`Members.gather`).
        max_spread: `guards.rank_check.max_spread` (relative, see `rank_spread`).

    A NaN spread (a NaN loss) is not an alert here: the spike guard skips that step.
    """
    spread = rank_spread(rows)
    if spread.max().item() > max_spread:
        return {"loss_grad_norm_by_rank": rows.tolist(), "spread": spread.tolist()}
    return None


def mismatch_alert(rows: torch.Tensor) -> dict | None:
    """The `replica_mismatch` alert's detail, or None when all replicas of each shard agree.

    Args:
        rows: int64 (world_size, 2), one `[shard_index, checksum]` row per rank (`replica_mismatch`).
    """
    return {"shard_checksum_by_rank": rows.tolist()} if replica_mismatch(rows) else None


@torch.no_grad()
def replica_checksum(tensors: list[torch.Tensor]) -> int:
    """int64 sum of the raw bits of every tensor (wraps on overflow; any bit flip changes it)."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
    for p in tensors:
        bits = p.detach().contiguous().view(torch.int32 if p.element_size() == 4 else torch.int16)
        total += bits.to(torch.int64).sum()
    return int(total.item())


class RankChecks:
    """`guards.rank_check` and `guards.fingerprint` at their intervals, and the alerts they raise.

    Collectives over the step's members (`members`: the loop's `StepMembers`):
    every member calls them at the same steps and reaches the same decision. An alert is logged on
    every member and recorded (`recorder`: the step's recording member) as an event and a
    `rank_alerts` metric; under `guards.on_alert: restart` every member calls `settle` (an in-flight,
    checked checkpoint commits first: less work lost) and raises the alert's `GuardError`
    (`RankSpreadError`, `ReplicaMismatchError`).
    """

    def __init__(
        self,
        cfg: GuardsSection,
        par: Parallel,
        members: Members,
        recorder: Recorder,
        settle: Callable[[], object],
    ):
        self.cfg, self.par, self.members, self.recorder, self.settle = cfg, par, members, recorder, settle
        self.diverged = False  # the last fingerprint found a mismatch
        self.checked_step = -1  # the step of the last fingerprint

    def tags(self) -> dict[str, str]:
        """MLflow tag `replica_fingerprint`: whether the fingerprint applies."""
        on = self.members.holds_copies(self.par)
        return {"replica_fingerprint": "on" if on else "not applicable (fsdp: no two ranks hold the same weights)"}

    def monitor(self, step: int, local_loss: float, grad_norm: float, before_save: bool = False) -> None:
        """Cross-member sanity check and replica fingerprint at their intervals; the fingerprint also
        when `before_save` (every member got it from `StepMembers.agree`: a save may follow)."""
        g = self.cfg
        if step % g.rank_check.interval_steps == 0:
            rows = self.members.gather(torch.tensor([local_loss, grad_norm], dtype=torch.float64))
            detail = spread_alert(rows, g.rank_check.max_spread)
            if detail is not None:
                self.alert(step, "rank_spread", detail)
        if step % g.fingerprint.interval_steps == 0 or before_save:
            self.check_replicas(step)

    def fit_to_save(self, step: int) -> bool:
        """Before a save, on the members that save: the verdict of the fingerprint the members ran at
        this step (`monitor`: at its interval or `before_save`; every member ran it, so every saving
        member gets the same verdict); else, when every member reaches the save (`saves_together`),
        the fingerprint now (a collective); else (one replica saves alone) False."""
        if self.checked_step == step:
            return not self.diverged
        return self.members.saves_together and self.check_replicas(step)

    def check_replicas(self, step: int) -> bool:
        """Compare the checksums of the same shard across the members holding copies of it; alert
        on a mismatch. True if consistent, and under fsdp (no replicas: not applicable, tagged in
        MLflow at the start)."""
        members = self.members
        if not members.holds_copies(self.par):
            return True
        row = torch.tensor([self.par.shard_index, replica_checksum(self.par.local_parameters())], dtype=torch.int64)
        detail = mismatch_alert(members.gather(row))
        self.diverged, self.checked_step = detail is not None, step
        if detail is None:
            return True
        self.alert(step, "replica_mismatch", detail)
        return False

    def alert(self, step: int, kind: str, detail: dict) -> None:
        """Every member calls this with the same decision: log it; under `restart`, raise."""
        log.error("step %d: %s alert: %s", step, kind, detail)
        self.recorder.event(kind, step=step, **detail)
        self.recorder.metrics(step, {"rank_alerts": 1})
        if self.cfg.on_alert == "restart":
            self.settle()
            raise ALERT_ERRORS[kind](f"step {step}: {kind} {detail}")
