from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raytrain_ft.data.batches import split_passes
from raytrain_ft.data.manifest import Manifest, Shard, load_manifest
from raytrain_ft.data.order import EpochOrder, steps_per_epoch
from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.launch.datasource import rank_datasource


def order_of(dataset: str, seed: int = 0, epoch: int = 0, global_batch_size: int = 8) -> EpochOrder:
    return EpochOrder(dataset, load_manifest(dataset), seed, epoch, global_batch_size, micro_batch_size=2)


def test_epoch_order_is_a_seeded_permutation(dataset):
    m = load_manifest(dataset)
    order = order_of(dataset)
    assert order.steps == steps_per_epoch(m, 8, 2) == 74  # (599 - 3 lanes x 2 rows) // 8
    e0 = order.step_sample_ids(0, order.steps)
    assert e0.shape == (74, 8) and len(np.unique(e0)) == 74 * 8 and e0.max() < m.num_samples
    assert np.array_equal(e0, order_of(dataset).step_sample_ids(0, 74))
    assert not np.array_equal(e0, order_of(dataset, epoch=1).step_sample_ids(0, 74))
    assert not np.array_equal(e0, order_of(dataset, seed=1).step_sample_ids(0, 74))


def row_group_of(dataset: str) -> dict[int, tuple[str, int]]:
    """sample id -> (file, row group) from the manifest (ids are dense and written in order)."""
    out, m = {}, load_manifest(dataset)
    for shard in m.shards:
        first = shard.first_sample_id
        for g, n in enumerate(shard.row_group_rows):
            out.update({i: (shard.file, g) for i in range(first, first + n)})
            first += n
    return out


@pytest.fixture(scope="module")
def wide_row_groups(tmp_path_factory) -> str:
    """600 samples in row groups of 32 (19 row groups), the loader's format."""
    path = tmp_path_factory.mktemp("wide")
    n, rows = 600, 32
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * 3, dtype=np.int32)), 3)
    pq.write_table(pa.table({"sample_id": np.arange(n), "tokens": tokens}), path / "s.parquet", row_group_size=rows)
    groups = [min(rows, n - g) for g in range(0, n, rows)]
    manifest = Manifest(n, 2, 10, 0, "tokenizer.json", "synthetic", [Shard("s.parquet", 0, n, groups)])
    (path / "manifest.json").write_text(manifest.to_json())
    return str(path)


def test_global_batches_mix_one_row_group_per_lane(wide_row_groups):
    order = order_of(wide_row_groups, global_batch_size=8)  # 4 lanes of 2 rows
    ids = order.step_sample_ids(0, order.steps)
    assert order.steps == (600 - 3 * 32) // 8
    distinct = [len(set((step // 32).tolist())) for step in ids]  # row group = sample id // 32
    assert min(distinct) == 4  # min(global_batch_size / micro_batch_size, 16, row groups)


@pytest.mark.parametrize("start", [0, 1, 37, 73])
def test_seek_reads_exactly_the_remaining_steps(dataset, start):
    order = order_of(dataset, seed=3, epoch=2)
    lanes = list(range(order.num_lanes))
    pieces = order.pieces(lanes, start, order.steps)
    assert sum(p.num_rows for p in pieces) == (order.steps - start) * 8  # nothing before `start` is read
    tables = [order.read(pieces)]
    got = [mb["sample_id"] for mb in order.micro_batches(lanes, start, order.steps, tables)]
    assert np.array_equal(np.concatenate(got), order.step_sample_ids(0, order.steps)[start:].reshape(-1))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7, 12, 13])
def test_ranks_partition_every_global_batch(dataset, world_size):
    """Any world size up to one past the lanes, dividing 24 or not: the ranks' passes hold exactly the step's batch."""
    plan = BatchPlan(global_batch_size=24, micro_batch_size=2, world_size=world_size)
    order = order_of(dataset, global_batch_size=24)
    expected = order.step_sample_ids(0, order.steps)
    per_rank = []
    for rank in range(world_size):
        lanes = plan.lanes(rank)
        tables = [order.read(order.pieces(lanes, 0, order.steps))]
        micro = order.micro_batches(lanes, 0, order.steps, tables)
        steps = [split_passes(plan, rank, [next(micro) for _ in lanes]) for _ in range(order.steps)]
        per_rank.append([torch.cat([p["sample_id"] for p in passes]).tolist() for passes in steps])
    for step in range(order.steps):
        assert sorted(sum((r[step] for r in per_rank), [])) == sorted(expected[step].tolist())


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_row_group_is_read_by_one_rank_per_epoch(dataset, world_size, monkeypatch):
    """Counts the parquet row-group reads of every rank's Ray Data read tasks over a whole epoch."""
    reads: list[tuple[int, int]] = []  # (rank, row group)
    rank = 0
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile, "read_row_group", lambda f, i, **kw: reads.append((rank, i)) or real(f, i, **kw)
    )
    m = load_manifest(dataset)
    plan = BatchPlan(global_batch_size=12, micro_batch_size=2, world_size=world_size)
    steps = steps_per_epoch(m, 12, 2)
    for rank in range(world_size):
        for task in rank_datasource(dataset, m, 0, 0, 0, steps, plan, rank).get_read_tasks(1):
            list(task())
    per_group = Counter(group for _, group in reads)
    assert len(m.shards) == 1 and sum(per_group.values()) == len(per_group)  # no row group read twice
    where = row_group_of(dataset)
    trained = {where[i][1] for i in order_of(dataset, global_batch_size=12).step_sample_ids(0, steps).flat}
    assert set(per_group) == trained  # ...and exactly the row groups the epoch trains
    assert sorted({r for r, _ in reads}) == list(range(world_size))


def test_position_rolls_over_and_drops_the_partial_batch():
    pos = DataPosition()
    for _ in range(3):
        pos.advance(global_batch_size=8, steps_per_epoch=3)
    assert (pos.epoch, pos.consumed) == (1, 0)
    pos.advance(8, 3)
    restored = DataPosition()
    restored.load_state_dict(pos.state_dict())
    assert (restored.epoch, restored.consumed) == (1, 8)
