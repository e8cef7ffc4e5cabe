"""Ray Data input that starts at a checkpointed position (Ray Data iterators keep none).

`EpochDatasource` turns positions `[start, stop)` of an epoch's deterministic order
(`raytrain_ft.data.order`) into one read task per row-group segment; `rank_micro_batches` keeps
this rank's rows (`BatchPlan.owner`) and streams them as torch micro-batches with prefetch, in
order.
"""

from __future__ import annotations

from collections.abc import Iterator

import ray.data
import torch
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from raytrain_ft.data.manifest import Manifest
from raytrain_ft.data.order import EpochOrder
from raytrain_ft.data.position import BatchPlan

READ_CPUS = 0.1  # fractional: on a 2-CPU node the training workers hold most of the CPUs


class EpochDatasource(Datasource):
    def __init__(self, order: EpochOrder, start: int, stop: int):
        self.order, self.segments = order, order.segments(start, stop)

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        order = self.order
        return [
            ReadTask(lambda seg=seg: [order.read(seg)], BlockMetadata(seg.num_rows, None, None, None))
            for seg in self.segments
        ]


def rank_micro_batches(
    path: str, manifest: Manifest, seed: int, epoch: int, start: int, stop: int, plan: BatchPlan, rank: int
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches of positions [start, stop) of `epoch`, built with Ray Data."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False  # per-worker bars flood the job log
    ds = ray.data.read_datasource(
        EpochDatasource(EpochOrder(path, manifest, seed, epoch), start, stop), num_cpus=READ_CPUS
    )
    ds = ds.map_batches(
        plan.rank_rows, fn_kwargs={"rank": rank}, batch_format="pyarrow", batch_size=None, num_cpus=READ_CPUS
    )
    yield from ds.iter_torch_batches(batch_size=plan.micro_batch_size, prefetch_batches=4, drop_last=False)
