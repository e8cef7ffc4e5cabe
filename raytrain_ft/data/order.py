"""Deterministic per-epoch sample order and O(1) seek into it.

Order of epoch `e` (a function of `(seed, e)` alone): the dataset's parquet row groups
("blocks") are permuted with `numpy.random.default_rng([seed, e])`; the rows inside block `b` are
permuted with `default_rng([seed, e, b])`. Reads stay sequential (one row group at a time) while
the order still mixes the corpus. A global position maps to (block, row) through the cumulative
block sizes, so resuming at position `p` reads only the row groups from the one holding `p`
onward, slicing inside that first one; consumed samples are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_ft.data.manifest import Manifest


@dataclass(frozen=True)
class Segment:
    """Positions `[start, stop)` of an epoch's order, all inside one block."""

    block: int  # index into `EpochOrder.blocks`
    lo: int  # first row of the block's permuted rows
    hi: int  # one past the last row
    start: int  # global position of row `lo`

    @property
    def num_rows(self) -> int:
        return self.hi - self.lo


class EpochOrder:
    """The sample order of one epoch over the dataset at `path`."""

    def __init__(self, path: str, manifest: Manifest, seed: int, epoch: int):
        self.path, self.seed, self.epoch = path.rstrip("/"), seed, epoch
        self.blocks = [(s.file, g, n) for s in manifest.shards for g, n in enumerate(s.row_group_rows)]
        self.block_order = np.random.default_rng([seed, epoch]).permutation(len(self.blocks))
        sizes = np.array([self.blocks[b][2] for b in self.block_order], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])  # position of each permuted block's first row

    def segments(self, start: int, stop: int) -> list[Segment]:
        """Split positions `[start, stop)` into per-block segments, in order."""
        out = []
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            block_start, block_end = int(self.offsets[k]), int(self.offsets[k + 1])
            hi = min(stop, block_end)
            out.append(Segment(int(self.block_order[k]), start - block_start, hi - block_start, start))
            start, k = hi, k + 1
        return out

    def read(self, seg: Segment) -> pa.Table:
        """Rows of one segment: columns `position` (int64), `sample_id` (int64), `tokens`."""
        file, group, rows = self.blocks[seg.block]
        with fsspec.open(f"{self.path}/{file}", "rb") as f:
            table = pq.ParquetFile(f).read_row_group(group, columns=["sample_id", "tokens"])
        perm = np.random.default_rng([self.seed, self.epoch, seg.block]).permutation(rows)[seg.lo : seg.hi]
        table = table.take(pa.array(perm))
        positions = pa.array(np.arange(seg.start, seg.start + seg.num_rows, dtype=np.int64))
        return table.add_column(0, "position", positions)
