"""The any-world-size split (`BatchPlan`): pure, no Ray, no process group."""

from __future__ import annotations

import math

import pytest
import torch

from raytrain_ft.core.errors import ConfigError
from raytrain_ft.data.batches import split_passes
from raytrain_ft.data.position import BatchPlan, check_world_sizes


def step_of(g: int, m: int) -> list[dict[str, torch.Tensor]]:
    """One step's lane micro-batches in lane order: sample ids 100.. and tokens that carry the id."""
    ids = torch.arange(100, 100 + g)
    return [
        {"sample_id": ids[j * m : (j + 1) * m], "tokens": ids[j * m : (j + 1) * m, None].repeat(1, 5)}
        for j in range(g // m)
    ]


@pytest.mark.parametrize(("g", "m"), [(8, 2), (24, 2), (12, 3), (7, 1), (16, 4)])
def test_every_world_size_up_to_one_past_the_lanes_deals_the_global_batch_exactly_once(g, m):
    lanes = step_of(g, m)
    for w in range(1, min(g, g // m + 1) + 1):
        plan = BatchPlan(g, m, w)
        seen, passes_per_rank = [], set()
        for rank in range(w):
            passes = split_passes(plan, rank, [lanes[j] for j in plan.lanes(rank)])
            passes_per_rank.add(len(passes))
            share = torch.cat([p["sample_id"] for p in passes]).tolist()
            assert len(share) in (g // w, math.ceil(g / w))  # floor or ceil of the share
            assert all(len(p["sample_id"]) <= m for p in passes)  # never more than a micro-batch per pass
            assert all(torch.equal(p["tokens"][:, 0], p["sample_id"]) for p in passes)  # rows stay paired
            seen += share
        assert sorted(seen) == list(range(100, 100 + g))  # the whole global batch, no duplicates
        assert passes_per_rank == {plan.grad_accum_steps}  # same number of passes on every rank
        assert plan.grad_accum_steps == math.ceil(math.ceil(g / w) / m)
        assert plan.batch_balance == pytest.approx((g / w) / math.ceil(g / w))  # the sequence-level bound


def test_uneven_split_of_8_over_3_ranks_with_micro_batch_2():
    plan = BatchPlan(8, 2, 3)
    lanes = step_of(8, 2)
    got = [
        [p["sample_id"].tolist() for p in split_passes(plan, r, [lanes[j] for j in plan.lanes(r)])] for r in range(3)
    ]
    assert got == [[[100], [101]], [[102, 103], [104]], [[105, 106], [107]]]
    assert [plan.lanes(r) for r in range(3)] == [[0], [1, 2], [2, 3]]  # lane 2 straddles ranks 1 and 2
    assert plan.batch_balance == pytest.approx(8 / 9)


def test_a_rank_with_fewer_sequences_than_passes_gets_an_empty_pass():
    plan = BatchPlan(5, 1, 2)  # shares 2 and 3, 3 passes of one sequence
    lanes = step_of(5, 1)
    sizes = [[len(p["sample_id"]) for p in split_passes(plan, r, [lanes[j] for j in plan.lanes(r)])] for r in range(2)]
    assert sizes == [[1, 1, 0], [1, 1, 1]]  # spans [0, 2) and [2, 5)
    assert plan.pass_weight(0) == 0.0


def test_pass_weights_of_a_step_sum_to_the_world_size():
    """Each rank's weights sum to share x W / G; over all ranks W: averaged by the W-way all-reduce, 1."""
    for g, m, w in [(8, 2, 3), (1024, 4, 63), (1024, 4, 56), (24, 2, 5)]:
        plan = BatchPlan(g, m, w)
        total = sum(plan.pass_weight(plan.span(r)[1] - plan.span(r)[0]) for r in range(w))
        assert total == pytest.approx(w)


def test_gpu_7b_range_trains_at_every_size_with_the_stated_balance():
    check_world_sizes(1024, 4, range(16, 65))  # the shipped configs/gpu-7b.yaml range
    assert BatchPlan(1024, 4, 63).batch_balance == pytest.approx(0.956, abs=5e-4)
    assert BatchPlan(1024, 4, 64).batch_balance == 1.0


def test_even_split_keeps_one_micro_batch_per_pass():
    plan = BatchPlan(24, 2, 4)
    assert plan.grad_accum_steps == 3 and plan.batch_balance == 1.0
    assert [plan.span(r) for r in range(4)] == [(0, 6), (6, 12), (12, 18), (18, 24)]


def test_what_cannot_work_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="smaller than the world size 9") as e:
        check_world_sizes(8, 2, range(2, 10))
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="not a multiple of train.micro_batch_size=3"):
        BatchPlan(8, 3, 2)
