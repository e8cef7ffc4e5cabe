"""Ray Data input that starts at a checkpointed step (Ray Data iterators keep none).

`EpochDatasource` turns the row-group pieces one rank trains (`EpochOrder.pieces` of the rank's
lanes, `raytrain_ft.data.order`) into read tasks of consecutive pieces: a row group is read only by
the ranks whose spans its lane holds (one when the world size divides the lanes).
`rank_micro_batches` streams the blocks in order with prefetch and assembles them into this rank's
micro-batches (numpy arrays). The read tasks unpickle this module and `raytrain_ft.data.order`: neither
imports torch, which a read task's worker process would import for nothing (about 1 s of CPU and
200 MB, on every worker group start).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from raytrain_ft.data.manifest import Manifest
from raytrain_ft.data.order import EpochOrder, Piece
from raytrain_ft.data.position import BatchPlan

# Read tasks declare no CPU. Ray Data reserves CPUs per pipeline from what the cluster has left
# beside the training workers, split in whole CPUs among concurrent pipelines: with one pipeline
# per rank and fewer free CPUs than ranks each pipeline got 0 and warned "Cluster resources are
# not enough to run any task". A rank's reads are I/O and decoding for its own training process.
# A 0-CPU task has no resource bound, so READ_CONCURRENCY bounds it: without it Ray Data started
# every read task of the epoch at once, each in a new Python worker process (raylet: "40 PYTHON
# worker processes have been started"), which starved the node and stalled elastic restarts.
# One task in flight per rank: the idle workers Ray keeps serve them at an attempt's start, where
# two per rank made the raylet start two or three new processes 13-15 s after each kill, on the
# first step's critical path (benchmarks/goodput.py: first batch 1.5 s after the restore, 0.4 s
# with one). A read task (512 rows) lasts far longer than training takes to consume it.
READ_CPUS = 0
READ_CONCURRENCY = 1  # read tasks in flight per rank
PREFETCH_BLOCKS = 4  # read tasks' blocks read ahead of training
ROWS_PER_READ_TASK = 512  # consecutive pieces share a read task (and its opened files) up to this many rows


def _read(order: EpochOrder, pieces: list[Piece]) -> list:
    """One read task's blocks: the rows of `pieces`, in order (one pyarrow table)."""
    return [order.read(pieces)]


class EpochDatasource(Datasource):
    def __init__(self, order: EpochOrder, pieces: list[Piece]):
        self.order, self.pieces = order, pieces

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        order, tasks, group = self.order, [], []
        for piece in self.pieces:
            group.append(piece)
            if sum(p.num_rows for p in group) >= ROWS_PER_READ_TASK or piece is self.pieces[-1]:
                rows = sum(p.num_rows for p in group)
                tasks.append(ReadTask(partial(_read, order, group), BlockMetadata(rows, None, None, None)))
                group = []
        return tasks


def rank_datasource(
    path: str, manifest: Manifest, seed: int, epoch: int, start: int, stop: int, plan: BatchPlan, rank: int
) -> EpochDatasource:
    """The read tasks of `rank` for steps [start, stop) of `epoch`: the pieces of its lanes only."""
    order = EpochOrder(path, manifest, seed, epoch, plan.global_batch_size, plan.micro_batch_size)
    return EpochDatasource(order, order.pieces(plan.lanes(rank), start, stop))


def rank_micro_batches(
    path: str, manifest: Manifest, seed: int, epoch: int, start: int, stop: int, plan: BatchPlan, rank: int
) -> Iterator[dict[str, np.ndarray]]:
    """This rank's micro-batches of steps [start, stop) of `epoch`, read with Ray Data (`EpochOrder.micro_batches`)."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False  # per-worker bars flood the job log
    source = rank_datasource(path, manifest, seed, epoch, start, stop, plan, rank)
    ds = ray.data.read_datasource(source, num_cpus=READ_CPUS, concurrency=READ_CONCURRENCY)
    tables = ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=PREFETCH_BLOCKS)
    return source.order.micro_batches(plan.lanes(rank), start, stop, tables)
