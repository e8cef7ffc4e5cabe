"""Guards against silent failure. Every decision is identical on every rank.

* `SpikeGuard` (design notes, "skip abnormal batches"): after clipping, a step whose global grad
  norm is non-finite, or above `factor x median(last `window` accepted norms)` once `warmup`
  norms exist, is skipped: gradients zeroed, no optimizer step. The step counter, the LR
  scheduler and the data position still advance (the batch is consumed; the schedule stays a
  function of the step, as Megatron does for skipped iterations). The history is checkpointed.
  After `max_consecutive_skips` skips in a row the loop rolls back (see `loop.rollback`).
* `rank_spread` (design notes, "cheap silent-error detector"): relative spread
  `(max - min) / (|mean| + 1e-9)` of each column of the gathered [loss, grad_norm] rows.
* `replica_checksum`: replicas must hold bitwise-identical weights; the checksum is the int64
  sum of the raw bits of every parameter this rank holds, so any single flipped bit changes it.
  Under DDP every rank is a replica; under HSDP the ranks holding the same shard index (one per
  replica group) are compared (`replica_mismatch`); under FSDP there are no replicas and the check
  does not apply (see `raytrain_ft.parallel`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class ReplicaMismatchError(RuntimeError):
    """A guard alert under `guards.on_alert: restart`: Ray restarts from the last checkpoint."""


@dataclass
class SpikeGuard:
    factor: float = 10.0
    window: int = 100
    warmup: int = 100
    history: deque = field(default_factory=deque)  # accepted grad norms, newest last
    consecutive: int = 0  # skips in a row
    skipped: int = 0  # skips in the whole run

    def decide(self, grad_norm: float) -> tuple[bool, float | None]:
        """Return (skip, median of the history) and update the history/counters.

        `grad_norm` must be the same float on every rank (it is: DDP all-reduces the gradients
        before `clip_grad_norm_`), so the decision is too.
        """
        median = statistics.median(self.history) if self.history else None
        spike = median is not None and len(self.history) >= self.warmup and grad_norm > self.factor * median
        if not math.isfinite(grad_norm) or spike:
            self.consecutive += 1
            self.skipped += 1
            return True, median
        self.consecutive = 0
        self.history.append(grad_norm)
        while len(self.history) > self.window:
            self.history.popleft()
        return False, median

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


def rank_spread(rows: torch.Tensor) -> torch.Tensor:
    """Relative spread per column of a (world_size, k) float tensor -> (k,) float tensor."""
    return (rows.max(0).values - rows.min(0).values) / (rows.mean(0).abs() + 1e-9)


def gather_rows(values: list, group: dist.ProcessGroup, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """all_gather of one row per rank -> (world_size, len(values)) of `dtype`, on every rank."""
    row = torch.tensor(values, dtype=dtype)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows)


def replica_mismatch(rows: torch.Tensor) -> bool:
    """True when two ranks holding the same shard disagree.

    Args:
        rows: int64 (world_size, 2), one `[shard_index, checksum]` row per rank.
    """
    return any(len(set(rows[rows[:, 0] == s, 1].tolist())) > 1 for s in rows[:, 0].unique().tolist())


@torch.no_grad()
def replica_checksum(tensors: list[torch.Tensor]) -> int:
    """int64 sum of the raw bits of every tensor (wraps on overflow; any bit flip changes it)."""
    total = torch.zeros((), dtype=torch.int64, device=tensors[0].device)
    for p in tensors:
        bits = p.detach().contiguous().view(torch.int32 if p.element_size() == 4 else torch.int16)
        total += bits.to(torch.int64).sum()
    return int(total.item())
