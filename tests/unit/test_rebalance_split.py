"""`straggler.action: rebalance` as pure decisions: the split in proportion to speed, the plan that
trains it, the split in the checkpointed data position, and when it changes (no Ray, no process group)."""

from __future__ import annotations

import pytest
import torch

from raytrain_ft.core.hooks import StepResult
from raytrain_ft.data.batches import split_passes
from raytrain_ft.data.position import BatchPlan, DataPosition, Share
from raytrain_ft.resilience.rebalance import Rebalance, proportional_split, rebalanced
from raytrain_ft.resilience.straggler import StragglerDetector


def test_the_split_follows_the_measured_speed_and_keeps_every_sequence():
    assert proportional_split(12, [1.0, 0.5, 1.0]) == (5, 2, 5)  # 2.4 / 4.8 / 4.8 perfect
    assert proportional_split(12, [1.0, 1.0, 1.0]) == ()  # nobody flagged: the even rule
    assert proportional_split(7, [1.0, 0.01, 1.0, 1.0]) == (2, 1, 2, 2)  # at least one sequence each
    with pytest.raises(ValueError):
        proportional_split(2, [1.0, 0.5, 1.0])


def test_a_rebalanced_plan_trains_the_same_global_batch_once_with_the_same_weights():
    even, split = BatchPlan(12, 2, 3), BatchPlan(12, 2, 3, (5, 2, 5))
    assert split.shares == (5, 2, 5) and split.max_share == 5 and split.grad_accum_steps == 3
    assert [split.span(r) for r in range(3)] == [(0, 5), (5, 7), (7, 12)]
    lanes = [
        {"tokens": torch.arange(2 * i, 2 * i + 2)[:, None], "sample_id": torch.arange(2 * i, 2 * i + 2)}
        for i in range(6)
    ]
    ids = []
    for r in range(3):
        passes = split_passes(split, r, [lanes[i] for i in split.lanes(r)])
        assert len(passes) == split.grad_accum_steps  # the same passes on every rank: DDP's collectives match
        ids += torch.cat([p["sample_id"] for p in passes]).tolist()
    assert ids == list(range(12))  # every sequence of the step once, in lane order
    # the loop's pass weights sum to W over the ranks: the mean loss over the G sequences either way
    assert sum(split.pass_weight(n) for n in split.shares) == sum(even.pass_weight(n) for n in even.shares) == 3
    with pytest.raises(ValueError):
        BatchPlan(12, 2, 3, (6, 0, 6))
    assert rebalanced(Share(even, 1), (5, 2, 5)) == Share(split, 1)
    assert rebalanced(Share(even, 1), (6, 6)) == Share(even, 1)  # another world size: the even rule


def test_the_split_in_force_is_checkpointed_with_the_data_position():
    position = DataPosition(1, 24, (5, 2, 5))
    restored = DataPosition()
    restored.load_state_dict(position.state_dict())
    assert restored == position
    restored.load_state_dict({"epoch": 0, "consumed": 12})  # a checkpoint from before rebalance
    assert restored == DataPosition(0, 12, ())


def test_the_split_moves_at_a_flag_is_probed_at_the_even_split_moves_back_at_recovery_and_survives_a_resume():
    detector, position = StragglerDetector(threshold=1.5, window=3, min_slow_steps=2), DataPosition()
    rebalance = Rebalance(detector, position, 12, enabled=True, probe_every_steps=4)

    def step(s: int, rank1_s: float, shares: tuple[int, ...]) -> tuple[int, ...]:
        assert (position.split or (4, 4, 4)) == shares
        figures = [1.0 / shares[0], rank1_s / shares[1], 1.0 / shares[2]]
        rebalance.before_step(s)
        detector.observe(s, figures, shares)
        rebalance.after_optimizer_step(StepResult(s, 0.0, 0.0, False, None, 0.0, compute_s_per_seq=tuple(figures)))
        return position.split

    split = (5, 2, 5)
    assert step(1, 2.0, (4, 4, 4)) == ()
    assert step(2, 2.0, (4, 4, 4)) == split  # flagged at 2 (slow in 2 of 3): the next step trains 5/2/5
    assert detector.held == {1}  # its steps at the moved split do not count for its recovery
    # fast at its lone share (0.4 s for 2 sequences: 2/5 of the others' 1.0 s for 5), or balanced
    # (1.0 s): either reads recovered at one bound of the others' cost; held, neither moves the split
    assert [step(s, t, split) for s, t in ((3, 0.4), (4, 1.0), (5, 0.4))] == [split] * 3
    resumed_detector, resumed_position = StragglerDetector(1.5, 3, 2), DataPosition()
    resumed_position.load_state_dict(position.state_dict())
    resumed = Rebalance(resumed_detector, resumed_position, 12, enabled=True, probe_every_steps=4)
    resumed.before_step(6)
    assert set(resumed_detector.flagged) == {1} and resumed_position.split == split
    assert resumed_detector.flagged_at == {1: 5} and resumed_detector.held == {1}
    assert step(6, 2.0, split) == ()  # 4 steps since the split took force: the probe, 3 steps even
    assert detector.held == set()
    assert [step(s, 2.0, (4, 4, 4)) for s in (7, 8)] == [(), ()]
    assert step(9, 2.0, (4, 4, 4)) == split  # still slow at the even split: the split comes back
    assert [step(s, 0.4, split) for s in (10, 11, 12)] == [split] * 3
    assert step(13, 0.4, split) == ()  # the next probe
    assert step(14, 1.0, (4, 4, 4)) == ()
    assert step(15, 1.0, (4, 4, 4)) == ()  # fast in 2 probe steps: recovered, the even rule stays
    assert detector.flagged == {} and step(16, 1.0, (4, 4, 4)) == step(20, 1.0, (4, 4, 4)) == ()
    off = Rebalance(StragglerDetector(1.5, 3, 1), DataPosition(), 12, enabled=False, probe_every_steps=4)
    off.detector.observe(1, [1.0, 3.0, 1.0])
    off.after_optimizer_step(StepResult(1, 0.0, 0.0, False, None, 0.0, compute_s_per_seq=(1.0, 3.0, 1.0)))
    assert off.position.split == ()  # warn: the split never moves
