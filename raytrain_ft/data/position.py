"""The data position and the rule that splits each global batch across ranks.

The position is `(epoch, consumed)`: global samples consumed in the current epoch. It never
mentions ranks, so a checkpoint resumes at any world size. Step `s` of an epoch consumes the
global batch `s` of that epoch's order (`G = global_batch_size`): one micro-batch from each of the
`G / micro_batch_size` lanes of `raytrain_ft.data.order`. Lane (micro-batch slot) `j` goes to rank
`j % world_size` as its accumulation step `j // world_size`. Each rank therefore sees
`grad_accum_steps` micro-batches per step, and the union over ranks is exactly the global batch,
whatever the world size.

Epoch end: an epoch has `steps_per_epoch` full steps (`raytrain_ft.data.order`); the samples the
lanes hold beyond them are not trained in that epoch (a different set every epoch, since the order
is re-permuted), so every step trains on a full global batch and resume at the boundary needs no
carried-over state.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_ft.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How `global_batch_size` splits into micro-batches at one world size.

    Raises:
        ConfigError: `global_batch_size` is not a multiple of `micro_batch_size x world_size`.
    """

    global_batch_size: int
    micro_batch_size: int
    world_size: int

    def __post_init__(self):
        per_step = self.micro_batch_size * self.world_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size x world_size = {self.micro_batch_size} x {self.world_size}; "
                f"choose a global_batch_size divisible by {per_step}"
            )

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def lanes(self, rank: int) -> list[int]:
        """The lanes (micro-batch slots, `raytrain_ft.data.order`) `rank` trains, in accumulation order."""
        return list(range(rank, self.global_batch_size // self.micro_batch_size, self.world_size))


def check_world_sizes(global_batch_size: int, micro_batch_size: int, world_sizes: range) -> None:
    """Fail at start if some world size the run may take has no valid split.

    Raises:
        ConfigError: for the first world size without a valid split.
    """
    for w in world_sizes:
        BatchPlan(global_batch_size, micro_batch_size, w)


@dataclass
class DataPosition:
    """Stateful data position: epoch and samples consumed in it (rank-free, see module doc)."""

    epoch: int = 0
    consumed: int = 0

    def advance(self, global_batch_size: int, steps_per_epoch: int) -> None:
        """Move past one global batch, rolling over to the next epoch at its last full step."""
        self.consumed += global_batch_size
        if self.consumed >= steps_per_epoch * global_batch_size:
            self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
