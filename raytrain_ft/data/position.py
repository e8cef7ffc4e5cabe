"""The data position and the rule that splits each global batch across ranks, at any world size.

The position is `(epoch, consumed)`: global samples consumed in the current epoch. It never
mentions ranks, so a checkpoint resumes at any world size. Step `s` of an epoch consumes the
global batch `s` of that epoch's order (`G = global_batch_size` sequences): one micro-batch of
`micro_batch_size` (m) rows from each of the `L = G / m` lanes of `raytrain_ft.data.order`, which
lists the step's G sequences in lane order.

The split (`BatchPlan`), for any world size W <= G: rank r trains the contiguous sequences
`[r*G // W, (r+1)*G // W)` of that list, i.e. floor(G/W) or ceil(G/W) of them, in
`grad_accum_steps = ceil(ceil(G/W) / m)` forward/backward passes of at most m sequences. Every
rank runs the same number of passes, so the collectives of DDP (one all-reduce on the last
pass), FSDP2 and HSDP (all-gathers and reduce-scatters on every pass) stay matched; a rank's
share is dealt over its passes as evenly as possible (sizes differ by at most one), and a rank
whose share is shorter than the passes (only possible at m = 1) runs a zero-weight pass.

Granularity: sequences, not micro-batches. A micro-batch-granular split (whole lanes per rank)
at G=8, m=2, W=3 deals the 4 lanes 2/1/1: the ranks train 4/2/2 sequences and two of them idle
half the step (balance 8 / (3 x 4) = 0.67); the sequence split trains 2/3/3 (0.89). For G=1024,
m=4, W=63: 0.81 vs 0.956. The cost is read amplification: each rank reads the whole row groups of
the lanes its span touches, so a lane that straddles two spans is read by both (at most W - 1
extra lane reads per step; 1.18 reads per lane for gpu-7b at W=63). `batch_balance = G / (W x ceil(G/W))`
(1.0 when W divides G) is the best any sequence-level split reaches, and this one reaches it.

The gradient is that of the mean loss over the G sequences whatever the split: the loop weighs a
pass of n sequences by `n x W / G` (`BatchPlan.pass_weight`), and every strategy averages
gradients over the W ranks (`raytrain_ft.model.parallel`), so the sum over ranks and passes is
`sum(per-sequence loss) / G`.

Epoch end: an epoch has `steps_per_epoch` full steps (`raytrain_ft.data.order`); the samples the
lanes hold beyond them are not trained in that epoch (a different set every epoch, since the order
is re-permuted), so every step trains on a full global batch and resume at the boundary needs no
carried-over state.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_ft.core.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How `global_batch_size` sequences split over `world_size` ranks (module doc).

    `split`: every rank's share, set by `straggler.action: rebalance`
    (`raytrain_ft.resilience.rebalance`); empty: the even rule of the module doc.

    Raises:
        ConfigError: `global_batch_size` is not a multiple of `micro_batch_size` (the data order's
            lanes), or is smaller than `world_size` (a rank would train nothing).
        ValueError: a `split` that is not `world_size` shares of at least one sequence summing to
            `global_batch_size`.
    """

    global_batch_size: int
    micro_batch_size: int
    world_size: int
    split: tuple[int, ...] = ()

    def __post_init__(self):
        g, m, w = self.global_batch_size, self.micro_batch_size, self.world_size
        if m < 1 or g % m:
            raise ConfigError(
                f"train.global_batch_size={g} is not a multiple of train.micro_batch_size={m}; "
                f"choose a global_batch_size divisible by {m}"
            )
        if g < w:
            raise ConfigError(
                f"train.global_batch_size={g} is smaller than the world size {w}: every rank needs at least one "
                f"sequence per step; raise global_batch_size to at least {w} or lower scaling.num_workers"
            )
        if self.split and (len(self.split) != w or sum(self.split) != g or min(self.split) < 1):
            raise ValueError(f"split {self.split} is not {w} shares of at least 1 summing to {g}")

    @property
    def shares(self) -> tuple[int, ...]:
        """Every rank's sequences per step, in rank order."""
        return tuple(self.share(r) for r in range(self.world_size))

    @property
    def max_share(self) -> int:
        """Sequences of the largest rank share: ceil(G / W) (the even rule)."""
        return max(self.split) if self.split else -(-self.global_batch_size // self.world_size)

    @property
    def grad_accum_steps(self) -> int:
        """Forward/backward passes per step, the same on every rank: ceil(ceil(G / W) / m)."""
        return -(-self.max_share // self.micro_batch_size)

    @property
    def batch_balance(self) -> float:
        """G / (W x largest share): 1.0 when W divides G; the sequence-level bound otherwise."""
        return self.global_batch_size / (self.world_size * self.max_share)

    def describe(self, rank: int) -> str:
        """The plan as `rank` trains it, in words (the loop's start log)."""
        return (
            f"world size {self.world_size}, {self.share(rank)} sequences per step in {self.grad_accum_steps} passes, "
            f"batch_balance {self.batch_balance:.3f}"
        )

    def span(self, rank: int) -> tuple[int, int]:
        """`[lo, hi)`: the sequences (positions in the step's lane order) `rank` trains."""
        if self.split:
            lo = sum(self.split[:rank])
            return lo, lo + self.split[rank]
        g, w = self.global_batch_size, self.world_size
        return rank * g // w, (rank + 1) * g // w

    def share(self, rank: int) -> int:
        """Sequences `rank` trains per step: floor or ceil of G / W (the even rule)."""
        lo, hi = self.span(rank)
        return hi - lo

    def lanes(self, rank: int) -> list[int]:
        """The lanes (micro-batch slots, `raytrain_ft.data.order`) holding `rank`'s span, in order."""
        lo, hi = self.span(rank)
        m = self.micro_batch_size
        return list(range(lo // m, (hi - 1) // m + 1))

    def pass_weight(self, sequences: int) -> float:
        """Loss weight of a pass of `sequences` sequences: `sequences x W / G` (module doc)."""
        return sequences * self.world_size / self.global_batch_size


def check_world_sizes(global_batch_size: int, micro_batch_size: int, world_sizes: range) -> None:
    """Fail at start if some world size the run may take has no valid split.

    Raises:
        ConfigError: for the first world size without a valid split.
    """
    for w in world_sizes:
        BatchPlan(global_batch_size, micro_batch_size, w)


@dataclass(frozen=True)
class Share:
    """One step's batch split and this rank's place in it (`plan.span(rank)` are its sequences)."""

    plan: BatchPlan
    rank: int


@dataclass
class DataPosition:
    """Stateful data position: epoch and samples consumed in it (rank-free, see module doc), and
    `split`, the rebalanced shares in force (`BatchPlan.split`; empty: the even rule), checkpointed
    with it so a resume trains the same split."""

    epoch: int = 0
    consumed: int = 0
    split: tuple[int, ...] = ()

    def advance(self, global_batch_size: int, steps_per_epoch: int) -> None:
        """Move past one global batch, rolling over to the next epoch at its last full step."""
        self.consumed += global_batch_size
        if self.consumed >= steps_per_epoch * global_batch_size:
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "split": list(self.split)}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self.split = tuple(int(n) for n in state.get("split", ()))  # checkpoints before rebalance have none
