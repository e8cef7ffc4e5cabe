"""A `Session` without Ray, for `torchrun` and the benchmarks: pyarrow reads, file-based commits.

Commits are recorded by rank 0 in `<run folder>/latest_checkpoint` (written to a temporary file
and renamed, so it always names a complete checkpoint). Preemption notices do not exist here.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import EpochOrder
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.launch.run_files import read_latest_checkpoint, write_latest_checkpoint
from raytrain_ft.tracking import RunLogger


class LocalSession:
    def __init__(self, run_root: str, data_path: str, seed: int, tracking_uri: str, mlflow_run_id: str):
        self.run_root, self.data_path, self.seed = run_root.rstrip("/"), data_path, seed
        self.tracking_uri, self.mlflow_run_id = tracking_uri, mlflow_run_id
        self.manifest = load_manifest(data_path)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def run_logger(self, attempt: bool) -> RunLogger:
        return RunLogger(self.tracking_uri, self.mlflow_run_id)  # in this process: no restarts here

    def latest_checkpoint(self) -> str | None:
        return read_latest_checkpoint(self.run_root)

    def commit(self, step: int, path: str, metrics: dict[str, float]) -> None:
        if dist.get_rank() == 0:
            write_latest_checkpoint(self.run_root, path)

    def flush(self) -> None:
        dist.barrier()

    def preemption_pending(self) -> bool:
        return False

    def micro_batches(
        self, epoch: int, start: int, stop: int, plan: BatchPlan, rank: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        order = EpochOrder(
            self.data_path, self.manifest, self.seed, epoch, plan.global_batch_size, plan.micro_batch_size
        )
        lanes = plan.lanes(rank)
        tables = (order.read([p]) for p in order.pieces(lanes, start, stop))
        for mb in order.micro_batches(lanes, start, stop, tables):
            yield {k: torch.from_numpy(v) for k, v in mb.items()}
