"""The straggler decision as a pure function of the ranks' figures (no Ray, no process group)."""

from __future__ import annotations

import time

import pytest
import torch

from raytrain_ft.resilience.straggler import ComputeTimer, Straggler, StragglerDetector, predicted_s, slowness


def test_slowness_compares_each_rank_with_the_median_of_the_others():
    assert slowness([1.0, 1.0, 2.0]) == pytest.approx([2 / 3, 2 / 3, 2.0])  # rank 0: 1.0 / median(1.0, 2.0)
    assert slowness([3.0]) == [1.0]  # alone: nothing to compare with
    assert slowness([0.0, 0.0]) == [1.0, 1.0]  # nothing measured


def test_a_rank_is_flagged_only_when_slow_in_k_of_the_last_n_steps_and_recovers_the_same_way():
    detector = StragglerDetector(threshold=1.5, window=5, min_slow_steps=3)
    healthy, slow = [1.0, 1.0, 1.0], [1.0, 1.0, 2.0]
    # one-step blips (a rank descheduled once, twice within the window) are never a straggler
    assert [detector.observe(s, f) for s, f in enumerate([slow, healthy, healthy, slow, healthy], 1)] == [([], [])] * 5
    assert detector.observe(6, slow) == ([], [])  # slow at 4 and 6: two of the last five
    flagged, _ = detector.observe(7, slow)  # 4, 6, 7: three of the last five
    assert flagged == [Straggler(rank=2, factor=2.0, first_step=4)]
    assert detector.observe(8, slow) == ([], [])  # flagged once, not again
    assert detector.observe(9, healthy) == ([], [])
    assert detector.observe(10, healthy) == ([], [])  # fast in 9, 10 and 5 falls out: 2 of 5
    _, recovered = detector.observe(11, healthy)  # fast in 9, 10, 11
    assert [r.rank for r in recovered] == [2]
    assert detector.flagged == {}


def test_recovery_counts_only_the_steps_after_the_flag():
    detector = StragglerDetector(threshold=1.5, window=10, min_slow_steps=3)
    healthy, slow = [1.0, 1.0, 1.0], [1.0, 1.0, 2.0]
    for s in range(1, 8):
        detector.observe(s, healthy)
    assert detector.observe(8, slow) == detector.observe(9, slow) == ([], [])
    assert detector.observe(10, slow)[0] == [Straggler(2, 2.0, 8)]
    # the window still holds 7 fast steps from before the flag: they do not undo it
    assert detector.observe(11, healthy) == detector.observe(12, healthy) == ([], [])
    assert [r.rank for r in detector.observe(13, healthy)[1]] == [2]


def test_recovery_at_a_lone_share_is_judged_against_the_lower_bound_of_the_others_cost():
    # rank 0 trains 2 sequences, the others 5: a + b x share with one share among the others is
    # bounded by [t x 2/5, t]; recovery needs its step at most threshold x the lower bound
    assert predicted_s([(5, 1.0), (5, 1.0)], 2, "lower") == pytest.approx(0.4)
    assert slowness([1.0 / 2, 0.2, 0.2], [2, 5, 5], "lower")[0] == pytest.approx(2.5)
    detector = StragglerDetector(threshold=1.5, window=4, min_slow_steps=2)
    detector.assume(Straggler(0, 2.5, 1), 1)
    balanced = [1.0 / 2, 1.0 / 5, 1.0 / 5]  # as long as the others: still slow where cost is per sequence
    assert [detector.observe(s, balanced, [2, 5, 5]) for s in (2, 3, 4)] == [([], [])] * 3
    recovered = [0.4 / 2, 1.0 / 5, 1.0 / 5]  # 2/5 of their time: what a healthy rank takes per sequence
    assert detector.observe(5, recovered, [2, 5, 5]) == ([], [])
    assert [r.rank for r in detector.observe(6, recovered, [2, 5, 5])[1]] == [0]


def test_a_rank_with_a_smaller_share_is_judged_against_the_cost_the_others_predict_for_it():
    # the measured false flag: 2/3/3 sequences in the same 2 passes, the step's cost a fixed cost
    # per pass (tiny model): 0.112 / 0.1 / 0.1 s, i.e. 1.68x the others per sequence; not a straggler
    per_seq = [0.112 / 2, 0.1 / 3, 0.1 / 3]
    assert slowness(per_seq, [2, 3, 3]) == pytest.approx([1.12, 0.1 / 0.106, 0.1 / 0.106])  # b < 0 fitted: 0
    assert slowness(per_seq)[0] == pytest.approx(1.68)  # per sequence alone: the false flag
    # a lone smaller share: the bound is the others' step time, so a cost proportional to the share
    # (a large model) is seen at share / theirs of the true slowness (2/3 here), never above it
    assert slowness([0.2 / 2, 0.3 / 3, 0.3 / 3], [2, 3, 3])[0] == pytest.approx(2 / 3)
    assert slowness([0.3 / 4, 0.2 / 2, 0.2 / 2], [4, 2, 2])[0] == pytest.approx(1.5 / 2)  # larger: per sequence
    # two distinct shares among the others: a + b x share fitted (here a = 0.1, b = 0.05)
    assert predicted_s([(2, 0.2), (4, 0.3), (4, 0.3)], 3) == pytest.approx(0.25)
    assert predicted_s([(2, 0.2), (4, 0.3)], 6) == pytest.approx(0.4)
    assert predicted_s([(2, 0.3), (4, 0.2)], 3) == pytest.approx(0.25)  # b < 0 clamped to 0: the mean
    detector = StragglerDetector(threshold=1.5, window=3, min_slow_steps=1)
    assert detector.observe(1, per_seq, [2, 3, 3]) == ([], [])
    assert detector.observe(2, [0.224 / 2, 0.1 / 3, 0.1 / 3], [2, 3, 3])[0] == [Straggler(0, pytest.approx(2.24), 2)]


def test_a_flagged_members_figure_predicts_no_other_members_cost():
    # the measured false flag (W=4, simulated device): rank 1 (factor 2) rebalanced to 2 of (4, 2, 3, 3);
    # cost per sequence 0.05 s; healthy rank 0 at its lone share of 4 measures 1.4x in a noisy step
    shares, noisy = [4, 2, 3, 3], [1.4 * 0.05, 2 * 0.05, 0.05, 0.05]
    # with rank 1 in the fit: (2, 0.2) and (3, 0.15), slope clamped to 0, the mean 0.175 predicted for 4
    assert slowness(noisy, shares)[0] == pytest.approx(0.28 / 0.175)
    # rank 1 known slow: the others at 3 bound rank 0's 4 at 0.15 x 4/3
    assert slowness(noisy, shares, flagged={1})[0] == pytest.approx(1.4)
    assert slowness([0.05, 0.1], [2, 2], flagged={0, 1}) == pytest.approx([0.5, 2.0])  # no one else: all
    detector = StragglerDetector(threshold=1.5, window=3, min_slow_steps=2)
    detector.assume(Straggler(1, 2.0, 1), 1)
    assert [detector.observe(s, noisy, shares) for s in (2, 3, 4)] == [([], [])] * 3


def test_a_change_of_the_members_starts_the_judgement_afresh():
    detector = StragglerDetector(threshold=1.5, window=4, min_slow_steps=2)
    detector.observe(1, [1.0, 1.0, 3.0])
    assert detector.observe(2, [1.0, 3.0]) == ([], [])  # two members now: rank 1 is not the old rank 2
    assert detector.observe(3, [1.0, 3.0])[0] == [Straggler(1, 3.0, 2)]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_slow_steps"):
        StragglerDetector(threshold=1.5, window=3, min_slow_steps=4)
    with pytest.raises(ValueError, match="threshold > 1"):
        StragglerDetector(threshold=1.0, window=3, min_slow_steps=1)


def test_the_compute_timer_ends_at_the_last_gradient_not_at_the_end_of_the_wait():
    model = torch.nn.Linear(4, 4)
    timer = ComputeTimer(model, torch.device("cpu"))
    with timer:
        model(torch.ones(2, 4)).sum().backward()
        ready = timer.ready
        time.sleep(0.05)  # a wait after the gradients are ready (DDP's all-reduce tail)
    assert timer.seconds == ready - timer.started
    assert timer.seconds < 0.05
