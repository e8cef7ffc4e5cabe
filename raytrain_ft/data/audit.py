"""Data audit (`data.audit: true`): which sample ids every rank consumed at every step.

Rank 0 gathers each step's ids (`raytrain_ft.resilience.replicas`' `gather`: an `all_gather` of a fixed-size
int64 tensor on a CPU gloo group, or, under replica recovery, over the step's replicas, each of which
buffers them as its group's rank 0) and buffers them; at every checkpoint commit the buffer is written to
`<run folder>/audit/<time_ns>-<first step>-<last step>.parquet` (columns `step`, `rank`,
`sample_id`). Steps trained after the last commit of a failed attempt are never written: their
work was rolled back. A step written by several attempts (after a fallback from a corrupt
checkpoint) is read from the latest file: `read_audit` returns the lineage of the final model.
`DataAudit` is a step hook (`raytrain_ft.core.hooks`): it records in `after_batch`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from raytrain_ft.core.hooks import StepHook
from raytrain_ft.core.run_folder import AUDIT_DIR, run_file

PAD = -1  # no sample (sample ids are >= 0)


class DataAudit(StepHook):
    """One rank's side of the audit; a no-op object when disabled."""

    def __init__(self, run_root: str, gather: Callable[[torch.Tensor], torch.Tensor], enabled: bool, width: int):
        """`gather`: (width,) int64 of this rank -> (ranks of the step, width) of every rank that trains
        the step (`raytrain_ft.resilience.replicas`: the whole group, or a step's replicas); `width`: the most
        sample ids a rank trains per step (`BatchPlan.max_share`)."""
        self.run_root, self.gather, self.enabled, self.width = run_root.rstrip("/"), gather, enabled, width
        self.rows: list[tuple[int, np.ndarray]] = []  # (step, ids of shape (world_size, width), PAD where shorter)

    def record(self, step: int, sample_ids: torch.Tensor) -> None:
        """Gather this step's ids from every rank (collective; `sample_ids` int64, at most `width` of them:
        shorter shares of an uneven split are padded to `width` for the fixed-size gather). A step
        recorded again (one that did not commit, trained again) replaces the earlier record."""
        if not self.enabled:
            return
        ids = torch.full((self.width,), PAD, dtype=torch.int64)
        ids[: len(sample_ids)] = sample_ids.to("cpu", torch.int64)
        gathered = self.gather(ids)
        if dist.get_rank() == 0:
            self.discard_after(step - 1)
            self.rows.append((step, gathered.numpy()))

    def after_batch(self, step: int, micro_batches: list[dict]) -> None:
        """Record the `sample_id`s of this rank's micro-batches (collective)."""
        self.record(step, torch.cat([mb["sample_id"] for mb in micro_batches]))

    def discard_after(self, step: int) -> None:
        """Drop buffered steps after `step` (their work was rolled back)."""
        self.rows = [(s, ids) for s, ids in self.rows if s <= step]

    def state_dict(self) -> dict:
        """The buffered (not yet written) steps: `steps` (n,) int64 and `ids`, n int64 tensors of
        shape (ranks of the step, width). Not checkpointed: a replica that heals under replica
        recovery takes its peer's (`raytrain_ft.resilience.replicas`), so the steps trained before it joined
        are written by whichever replica commits the next checkpoint."""
        return {
            "steps": torch.tensor([s for s, _ in self.rows], dtype=torch.int64),
            "ids": [torch.from_numpy(ids) for _, ids in self.rows],
        }

    def load_state_dict(self, state: dict) -> None:
        self.rows = [(int(s), ids.numpy()) for s, ids in zip(state["steps"], state["ids"], strict=True)]

    def flush(self) -> None:
        """Write the buffered steps (rank 0; called when a checkpoint commits)."""
        if not self.enabled or dist.get_rank() != 0 or not self.rows:
            return
        steps, ranks, ids = [], [], []
        for step, per_rank in self.rows:
            w, n = per_rank.shape
            kept = per_rank.reshape(-1) != PAD
            steps.append(np.full(w * n, step, np.int64)[kept])
            ranks.append(np.repeat(np.arange(w, dtype=np.int64), n)[kept])
            ids.append(per_rank.reshape(-1)[kept])
        table = pa.table(
            {"step": np.concatenate(steps), "rank": np.concatenate(ranks), "sample_id": np.concatenate(ids)}
        )
        fs, base = fsspec.core.url_to_fs(run_file(self.run_root, AUDIT_DIR))
        fs.makedirs(base, exist_ok=True)
        # written under a temporary name, then renamed: a rank killed mid-write (an elastic resize
        # tearing the group down during a save) leaves a `.partial` file, never a torn audit file
        path = f"{base}/{time.time_ns()}-{self.rows[0][0]}-{self.rows[-1][0]}.parquet"
        with fs.open(path + ".partial", "wb") as f:
            pq.write_table(table, f)
        fs.mv(path + ".partial", path)
        self.rows = []


def read_audit(run_root: str) -> pa.Table:
    """The audit of a run: one row per (step, rank, sample_id), the latest attempt per step, sorted by step.

    Raises:
        FileNotFoundError: the run wrote no audit (`data.audit` was off).
    """
    fs, base = fsspec.core.url_to_fs(run_file(run_root, AUDIT_DIR))
    written = [p for p in fs.ls(base, detail=False) if p.endswith(".parquet")]  # not `.partial` leftovers
    files = sorted(written, key=lambda p: int(p.rsplit("/", 1)[-1].split("-")[0]))
    latest: dict[int, pa.Table] = {}
    for path in files:  # oldest first: later files overwrite the steps they repeat
        with fs.open(path, "rb") as f:
            table = pq.read_table(f)
        for step in np.unique(table.column("step").to_numpy()):
            latest[int(step)] = table.filter(pc.equal(table.column("step"), step))
    return pa.concat_tables([latest[s] for s in sorted(latest)])
