import numpy as np
import pyarrow as pa
import pytest

from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import EpochOrder
from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.errors import ConfigError


def ids(order: EpochOrder, start: int, stop: int) -> np.ndarray:
    return pa.concat_tables([order.read(s) for s in order.segments(start, stop)]).column("sample_id").to_numpy()


def test_epoch_order_is_a_seeded_permutation(dataset):
    m = load_manifest(dataset)
    e0 = ids(EpochOrder(dataset, m, seed=0, epoch=0), 0, m.num_samples)
    assert np.array_equal(np.sort(e0), np.arange(m.num_samples))
    assert np.array_equal(e0, ids(EpochOrder(dataset, m, seed=0, epoch=0), 0, m.num_samples))
    assert not np.array_equal(e0, ids(EpochOrder(dataset, m, seed=0, epoch=1), 0, m.num_samples))
    assert not np.array_equal(e0, ids(EpochOrder(dataset, m, seed=1, epoch=0), 0, m.num_samples))


@pytest.mark.parametrize("start", [0, 1, 255, 256, 511, 598])
def test_seek_reads_exactly_the_remaining_positions(dataset, start):
    m = load_manifest(dataset)
    order = EpochOrder(dataset, m, seed=3, epoch=2)
    assert np.array_equal(ids(order, start, m.num_samples), ids(order, 0, m.num_samples)[start:])
    first = order.segments(start, m.num_samples)[0]
    assert first.start == start and first.num_rows <= 512  # only the row group holding `start` is sliced


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_partition_every_global_batch(world_size):
    plan = BatchPlan(global_batch_size=24, micro_batch_size=2, world_size=world_size)
    positions = np.arange(240)
    owner = plan.owner(positions)
    for step in range(10):
        batch = owner[step * 24 : (step + 1) * 24]
        assert [int((batch == r).sum()) for r in range(world_size)] == [2 * plan.grad_accum_steps] * world_size


def test_indivisible_split_is_a_config_error():
    with pytest.raises(ConfigError, match="not a multiple of micro_batch_size x world_size = 2 x 3"):
        BatchPlan(global_batch_size=8, micro_batch_size=2, world_size=3)


def test_position_rolls_over_and_drops_the_partial_batch():
    pos = DataPosition()
    for _ in range(3):
        pos.advance(global_batch_size=8, steps_per_epoch=3)
    assert (pos.epoch, pos.consumed) == (1, 0)
    pos.advance(8, 3)
    restored = DataPosition()
    restored.load_state_dict(pos.state_dict())
    assert (restored.epoch, restored.consumed) == (1, 8)
