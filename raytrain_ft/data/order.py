"""Deterministic per-epoch sample order: lanes of whole row groups, O(1) seek.

Epoch `e` of a run with `global_batch_size` G and `micro_batch_size` m is a function of
`(seed, e, G, m)` and the dataset alone, never of the world size:

- the dataset's parquet row groups are permuted with `numpy.random.default_rng([seed, e])`, and
  the rows inside row group `b` with `default_rng([seed, e, b])`;
- a global batch has `L = G / m` micro-batch slots, one per *lane*. The permuted row groups are
  dealt, whole, each to the lane holding the fewest rows so far (ties: the lowest lane), so a lane
  is a sequence of whole row groups and the lanes' lengths differ by at most one row group;
- step `s` of the epoch takes rows `[s*m, (s+1)*m)` of every lane: the step's G sequences in lane
  order, which `raytrain_ft.data.position.BatchPlan` splits into contiguous per-rank spans.

Consequences: every global batch comes from at least `min(L, row groups)` distinct row groups (one
per lane, more where a lane crosses into its next row group); a row group belongs to one lane and
a rank reads the lanes its span touches, so a row group is read by one rank per epoch when
every span boundary falls on a lane boundary (W divides G / m), and by the two ranks sharing a
straddled lane otherwise (when W > G / m, a lane can hold several ranks' spans: up to
`ceil(m / floor(G / W)) + 1` readers); which rank that is depends on the world size, the set of
sample ids of a step does not.

Epoch length: `steps_per_epoch = (N - (L - 1) * R_max) // G` for `N` samples and row groups of at
most `R_max` rows. Dealing to the lightest lane leaves every lane within `R_max` of the heaviest,
so the lightest holds at least `(N - (L - 1) * R_max) / L` rows (N = sum of the L lane lengths <=
L x lightest + (L - 1) x R_max) and every lane can fill every step. The rows past
`steps_per_epoch * m` in each lane, at most `(L - 1) * R_max + G - 1` samples, are not trained in
that epoch; the next epoch's permutation leaves out different ones. Smaller row groups
(`jobs/prepare_data.py --rows-per-row-group`) shrink that tail for small datasets.

Resume at step `s` seeks every lane to row `s*m` through its cumulative row-group lengths: only the
row groups from the one holding that row onward are read, the first one sliced.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_ft.core.errors import ConfigError
from raytrain_ft.data.manifest import Manifest
from raytrain_ft.data.position import BatchPlan, DataPosition


def steps_per_epoch(manifest: Manifest, global_batch_size: int, micro_batch_size: int) -> int:
    """Full global batches per epoch (module doc); raises ConfigError when the dataset has none."""
    lanes = global_batch_size // micro_batch_size
    max_rows = max(n for s in manifest.shards for n in s.row_group_rows)
    steps = (manifest.num_samples - (lanes - 1) * max_rows) // global_batch_size
    if steps < 1:
        raise ConfigError(
            f"the {manifest.num_samples} samples in row groups of up to {max_rows} rows cannot fill "
            f"{lanes} lanes (global_batch_size / micro_batch_size) for one step; prepare the dataset with "
            "a smaller --rows-per-row-group or lower global_batch_size / micro_batch_size"
        )
    return steps


@dataclass(frozen=True)
class Piece:
    """Rows `[lo, hi)` of row group `block`'s permuted rows, trained by `lane` from `first_step` on."""

    lane: int
    block: int  # index into `EpochOrder.blocks`
    lo: int
    hi: int
    first_step: int  # the step (of the epoch) that trains row `lo`

    @property
    def num_rows(self) -> int:
        return self.hi - self.lo


class EpochOrder:
    """The sample order of one epoch over the dataset at `path` (module doc)."""

    def __init__(
        self, path: str, manifest: Manifest, seed: int, epoch: int, global_batch_size: int, micro_batch_size: int
    ):
        self.path, self.seed, self.epoch = path.rstrip("/"), seed, epoch
        self.micro_batch_size, self.num_lanes = micro_batch_size, global_batch_size // micro_batch_size
        self.steps = steps_per_epoch(manifest, global_batch_size, micro_batch_size)
        # (file, row group, rows, sample id of its first row)
        self.blocks = [
            (s.file, g, n, s.first_sample_id + sum(s.row_group_rows[:g]))
            for s in manifest.shards
            for g, n in enumerate(s.row_group_rows)
        ]
        lanes: list[list[int]] = [[] for _ in range(self.num_lanes)]
        lightest = [(0, j) for j in range(self.num_lanes)]
        for b in np.random.default_rng([seed, epoch]).permutation(len(self.blocks)):
            rows, j = heapq.heappop(lightest)
            lanes[j].append(int(b))
            heapq.heappush(lightest, (rows + self.blocks[b][2], j))
        self.lane_blocks = lanes
        # lane j's row-group k starts at lane row lane_offsets[j][k]
        self.lane_offsets = [np.concatenate([[0], np.cumsum([self.blocks[b][2] for b in bs])]) for bs in lanes]

    def pieces(self, lanes: Iterable[int], start_step: int, stop_step: int) -> list[Piece]:
        """The row-group pieces that `lanes` train in steps `[start_step, stop_step)`, in the order
        they are first needed (by first step, then lane)."""
        m, out = self.micro_batch_size, []
        for j in lanes:
            offsets, lo, hi = self.lane_offsets[j], start_step * m, stop_step * m
            k = int(np.searchsorted(offsets, lo, side="right")) - 1
            while lo < hi:
                block_start = int(offsets[k])
                end = min(hi, int(offsets[k + 1]))
                out.append(Piece(j, self.lane_blocks[j][k], lo - block_start, end - block_start, lo // m))
                lo, k = end, k + 1
        return sorted(out, key=lambda p: (p.first_step, p.lane))

    def read(self, pieces: Sequence[Piece]) -> pa.Table:
        """Rows of `pieces`, in order: columns `lane` (int32), `sample_id` (int64), `tokens` (int32
        lists). Each piece reads its whole row group; a file is opened once per call."""
        tables, files = [], {}
        with contextlib.ExitStack() as stack:
            for piece in pieces:
                file, group, rows, first_id = self.blocks[piece.block]
                if file not in files:
                    files[file] = pq.ParquetFile(stack.enter_context(fsspec.open(f"{self.path}/{file}", "rb")))
                table = files[file].read_row_group(group, columns=["tokens"])
                perm = np.random.default_rng([self.seed, self.epoch, piece.block]).permutation(rows)[
                    piece.lo : piece.hi
                ]
                table = table.take(pa.array(perm))
                table = table.add_column(0, "sample_id", pa.array(first_id + perm.astype(np.int64)))
                tables.append(table.add_column(0, "lane", pa.array(np.full(piece.num_rows, piece.lane, np.int32))))
        return pa.concat_tables(tables)

    def micro_batches(
        self, lanes: list[int], start_step: int, stop_step: int, tables: Iterable[pa.Table]
    ) -> Iterator[dict[str, np.ndarray]]:
        """Assemble `lanes`' micro-batches for steps `[start_step, stop_step)`, step by step and lane
        by lane, from `tables`: the rows of `self.pieces(lanes, ...)` in that order (blocks may be
        split or merged). Each item: `sample_id` int64 (m,), `tokens` int64 (m, seq_len + 1).
        Holds at most one row group per lane plus the blocks read ahead."""
        m, tables = self.micro_batch_size, iter(tables)
        buffered: dict[int, list[pa.Table]] = {j: [] for j in lanes}
        for _step in range(start_step, stop_step):
            for j in lanes:
                while sum(len(t) for t in buffered[j]) < m:
                    table = next(tables)
                    lane = table.column("lane").to_numpy()
                    for k in np.unique(lane):
                        buffered[int(k)].append(table.filter(pa.array(lane == k)))
                rows = pa.concat_tables(buffered[j])
                buffered[j] = [rows.slice(m)]
                tokens = rows.column("tokens").slice(0, m).combine_chunks()
                yield {
                    # astype copies: arrow's zero-copy arrays are read-only, which torch.from_numpy warns about
                    "sample_id": rows.column("sample_id").slice(0, m).to_numpy().astype(np.int64),
                    "tokens": tokens.flatten().to_numpy().astype(np.int64).reshape(m, tokens.type.list_size),
                }

    def step_sample_ids(self, start_step: int, stop_step: int) -> np.ndarray:
        """Sample ids of steps `[start_step, stop_step)`: int64 (steps, G), row `i` in lane order.

        Reads the row groups directly (pyarrow); for rollback windows, audits and tests."""
        lanes = list(range(self.num_lanes))
        tables = [self.read(self.pieces(lanes, start_step, stop_step))]
        ids = [mb["sample_id"] for mb in self.micro_batches(lanes, start_step, stop_step, tables)]
        return np.concatenate(ids).reshape(stop_step - start_step, -1) if ids else np.zeros((0, 0), np.int64)


def window_sample_ids(
    path: str, manifest: Manifest, seed: int, position: DataPosition, plan: BatchPlan, steps: int
) -> list[int]:
    """Sample ids of the `steps` global batches from `position` on, across epoch ends (what a
    rollback skips), each step's in lane order."""
    g, m = plan.global_batch_size, plan.micro_batch_size
    ids, pos, per_epoch = [], DataPosition(position.epoch, position.consumed), steps_per_epoch(manifest, g, m)
    for _ in range(steps):
        order = EpochOrder(path, manifest, seed, pos.epoch, g, m)
        ids += order.step_sample_ids(pos.consumed // g, pos.consumed // g + 1).reshape(-1).tolist()
        pos.advance(g, per_epoch)
    return ids
