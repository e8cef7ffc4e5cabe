"""What the training loop needs from its runtime: the only seam between the loop and Ray.

The loop depends on `torch.distributed` and on this protocol; `raytrain_ft.launch.worker`
implements it with Ray Train and Ray Data. Another runtime (torchrun) would implement the same
members.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from raytrain_ft.checkpoint.memory_copies import Keepers
from raytrain_ft.core.recorder import Recorder
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.resilience.preemption import Notice
from raytrain_ft.resilience.recovery import RunHistory


class Session(Protocol):
    run_root: str  # the run's folder (local path or fsspec URL): checkpoints, fault markers, run id
    mlflow_run_id: str  # the run's MLflow run (recorded in each checkpoint)
    rank: int  # this worker's rank in the run (the process group's rank; under replica recovery, the replica's)
    # under replica recovery: the runtime started this worker in place of a failed replica while the
    # others kept training (`raytrain_ft.resilience.replicas.Role`); False otherwise
    replacement: bool
    node: str  # this worker's node, as events name it (the Ray node id; the host name without Ray)

    def recorder(self, attempt: bool) -> Recorder:
        """The run's recorder (`raytrain_ft.core.recorder`). `attempt=True` (rank 0, once per attempt):
        this attempt's, with a fresh step timeline; `attempt=False`: the run's recorder without a new
        timeline (under replica recovery, a replica that records steps but does not start the attempt)."""

    def history(self) -> RunHistory:
        """A copy of the run's history so far (when it began, its failures, attempt starts, hangs and
        rollbacks; `raytrain_ft.resilience.recovery.RunHistory` says who keeps it): what the loop decides with,
        instead of reading the tracking store."""

    def latest_checkpoint(self) -> str | None:
        """Path of the latest committed checkpoint, or None on a fresh start."""

    def memory_keepers(self, memory_dir: str) -> Keepers | None:
        """The nodes' keepers of the memory tier (`raytrain_ft.checkpoint.memory_copies.Keepers`), their
        copies under `memory_dir` (`checkpoint.memory.dir`); None where the runtime has none (the tier stays off)."""

    def commit(self, step: int, path: str, metrics: dict[str, float]) -> None:
        """Register a complete checkpoint (called on every rank with the same arguments)."""

    def flush(self) -> None:
        """Return once the runtime has registered every earlier commit (called on every rank)."""

    def beat(self, step: int) -> None:
        """This rank completed `step` (called after every step, on every rank): the runtime's progress
        watchdog (`raytrain_ft.resilience.watchdog`) stops a rank that stops beating. Returns at once."""

    def preemption_notice(self) -> Notice | None:
        """The drain notice of this worker's node, None while it has none; returns at once (not a
        collective: `raytrain_ft.resilience.preemption` says how the step's members agree on it)."""

    def micro_batches(
        self, epoch: int, start: int, stop: int, plan: BatchPlan, rank: int
    ) -> Iterator[dict[str, np.ndarray]]:
        """The micro-batches of `rank` of `plan` for steps [start, stop) of `epoch` (`plan.lanes(rank)`
        of each step), in order. `rank` is this worker's place in the step's split: its process-group
        rank, or under replica recovery its rank in the step's quorum (not `self.rank`).

        Each item: `tokens` int64 (micro_batch_size, seq_len + 1), `sample_id` int64 (micro_batch_size,),
        numpy arrays (`raytrain_ft.data.batches.split_passes` makes the step's tensors).
        """
