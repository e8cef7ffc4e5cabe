"""A `Session` without Ray, for `torchrun` and the benchmarks: pyarrow reads, file-based commits.

Commits are recorded by rank 0 in `<run folder>/latest_checkpoint` (`run_folder.write_latest`:
it always names a complete checkpoint). Preemption notices do not exist here.
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Iterator

import numpy as np
import torch.distributed as dist

from raytrain_ft.core.run_folder import read_latest, write_latest
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import EpochOrder
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.resilience.recovery import RunHistory
from raytrain_ft.telemetry.outbox import bound_requests
from raytrain_ft.telemetry.tracking import MlflowRecorder


class LocalSession:
    replacement = False  # no replica recovery without Ray
    node = socket.gethostname()

    def __init__(
        self,
        run_root: str,
        data_path: str,
        seed: int,
        tracking_uri: str,
        mlflow_run_id: str,
        tracking_timeout_s: float = 30.0,
    ):
        self.run_root, self.data_path, self.seed = run_root.rstrip("/"), data_path, seed
        self.tracking_uri, self.mlflow_run_id = tracking_uri, mlflow_run_id
        self.manifest = load_manifest(data_path)
        # one recorder for the whole run (no restarts here); it keeps the history it loads now
        bound_requests(tracking_timeout_s)  # `waits.tracking_timeout_s`: the recorder's outbox retries
        self.run_recorder = MlflowRecorder(tracking_uri, mlflow_run_id, timeout_s=tracking_timeout_s)
        self.run_recorder.history = self.run_recorder.load_history()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def recorder(self, attempt: bool) -> MlflowRecorder:
        return self.run_recorder

    def history(self) -> RunHistory:
        assert self.run_recorder.history is not None
        return copy.deepcopy(self.run_recorder.history)

    def memory_keepers(self, memory_dir: str) -> None:
        return None  # no keepers outside Ray: the memory tier stays off

    def latest_checkpoint(self) -> str | None:
        return read_latest(self.run_root)

    def commit(self, step: int, path: str, metrics: dict[str, float]) -> None:
        if dist.get_rank() == 0:
            write_latest(self.run_root, path)

    def flush(self) -> None:
        dist.barrier()

    def beat(self, step: int) -> None:
        pass  # no progress watchdog without Ray: a stalled local run waits on its collectives' timeout

    def preemption_notice(self) -> None:
        return None

    def micro_batches(
        self, epoch: int, start: int, stop: int, plan: BatchPlan, rank: int
    ) -> Iterator[dict[str, np.ndarray]]:
        order = EpochOrder(
            self.data_path, self.manifest, self.seed, epoch, plan.global_batch_size, plan.micro_batch_size
        )
        lanes = plan.lanes(rank)
        tables = (order.read([p]) for p in order.pieces(lanes, start, stop))
        return order.micro_batches(lanes, start, stop, tables)
