"""Ray Train 2.60's `TorchftConfig` (`failure.recovery: replica`), whose backend also tells a worker
whether Ray Train started it in place of a failed replica while the others kept training.

Ray Train starts a whole worker group (`WorkerGroup`: the run's start, or a restart of every
replica) or replaces one replica group (`ReplicaGroup`), and calls the backend's `on_start` on
what it started, before the train function runs. `ReplicaBackend` sets `REPLACEMENT_ENV`
there ("1" in a replacement), so the replica knows Ray's own decision instead of guessing it from
timings: a replacement starts no attempt of the run (`raytrain_ft.resilience.step_members.Role`). A module
of its own: Ray Train's controller runs the backend and ships it to the workers, which import it (no
MLflow, no model code here: the controller process never needs them).
"""

from __future__ import annotations

import os

from ray.train.v2.torch.torchft_config import TorchftConfig

from raytrain_ft.launch.ray_internals import ReplicaGroup, TorchftBackend

REPLACEMENT_ENV = "RAYTRAIN_FT_REPLACEMENT"  # "1" in a replacement's workers, "0" in a whole group's


def mark_replacement(replacement: bool) -> None:
    """Run in each worker Ray Train just started: whether it replaces a failed replica."""
    os.environ[REPLACEMENT_ENV] = "1" if replacement else "0"


class ReplicaBackend(TorchftBackend):
    def on_start(self, worker_group, backend_config) -> None:
        super().on_start(worker_group, backend_config)
        worker_group.execute(mark_replacement, isinstance(worker_group, ReplicaGroup))


class ReplicaConfig(TorchftConfig):
    """`TorchftConfig` with `ReplicaBackend`."""

    @property
    def backend_cls(self):
        return ReplicaBackend
