"""The driver's progress watchdog decisions (`raytrain_ft.resilience.watchdog.Progress`), without Ray: which bound
applies, when it fires, and which ranks did not arrive."""

from __future__ import annotations

import pytest

from raytrain_ft.resilience.watchdog import MIN_STEP_TIMEOUT_S, Progress, StepBeat


def two_ranks(step_timeout_s: float = 10.0, start_timeout_s: float = 60.0, max_steps: int = 30) -> Progress:
    p = Progress(step_timeout_s, start_timeout_s, max_steps)
    p.watch({0: (100, "n0"), 1: (101, "n1")}, now=0.0)
    return p


def test_a_start_is_judged_by_the_start_bound_and_steps_by_the_step_bound():
    p = two_ranks()
    assert p.stalled(59.0) is None  # 59 s of group start: within the 60 s start bound
    stall = p.stalled(61.0)
    assert stall is not None and (stall.ranks, stall.step, stall.bound_s) == ([0, 1], None, 60.0)
    p = two_ranks()
    for t, step in ((20.0, 1), (21.0, 2)):
        p.beat(0, step, t)
        p.beat(1, step, t)
    assert p.stalled(30.0) is None  # 9 s after step 2
    stall = p.stalled(31.5)
    assert stall is not None and (stall.step, stall.bound_s, stall.stalled_s) == (2, 10.0, pytest.approx(10.5))


def test_the_auto_step_bound_is_ten_median_steps_with_a_floor():
    p = two_ranks(step_timeout_s=0.0)
    assert p.step_bound_s() == MIN_STEP_TIMEOUT_S  # no step yet
    for step in range(1, 6):
        p.beat(0, step, 100.0 * step)  # 100 s steps
    assert p.step_bound_s() == 1000.0
    p.beat(0, 3, 600.0)  # a rollback to step 3 is no step-time sample
    assert p.step_bound_s() == 1000.0


def test_a_frozen_rank_is_named_by_its_oldest_step_or_else_by_its_process_state():
    p = two_ranks()
    for step in (1, 2, 3):
        p.beat(0, step, float(step))
        p.beat(1, step, float(step))
    p.beat(0, 4, 4.0)  # rank 1 never finished step 4 (frozen in its save); rank 0 waits in step 5
    stall = p.stalled(20.0)
    assert stall is not None and stall.ranks == [0, 1] and stall.step == 3
    assert p.not_arrived(stall, {0: "S", 1: "T"}) == [1]
    assert p.not_arrived(stall, {0: "S", 1: "S"}) == [1]  # the step alone says it
    p.beat(1, 4, 4.1)  # now both finished step 4 and wait inside step 5: only the state tells them apart
    stall = p.stalled(20.0)
    assert stall is not None and p.not_arrived(stall, {0: "S", 1: "T"}) == [1]
    assert p.not_arrived(stall, {0: "S", 1: "D"}) == [1]
    assert p.not_arrived(stall, {0: "S", 1: "S"}) == [0, 1]  # a stall inside a collective: both named


def test_a_replica_that_stalls_while_the_others_train_is_the_only_one_past_its_bound():
    p = two_ranks()
    for step in range(1, 20):
        p.beat(0, step, float(step))
    p.beat(1, 1, 1.0)
    stall = p.stalled(19.5)
    assert stall is not None and stall.ranks == [1] and p.not_arrived(stall, {}) == [1]
    p.forget([1], now=19.5)  # the watchdog stopped it; Ray Train replaces it
    assert p.stalled(19.5) is None and p.ranks[0].at == 19.5
    p.watch({1: (102, "n1")}, now=20.0)  # the replacement: judged by the start bound from its start
    p.beat(0, 20, 78.0)
    assert p.stalled(79.0) is None
    stall = p.stalled(81.0)
    assert stall is not None and (stall.ranks, stall.bound_s) == ([1], 60.0)


def test_ranks_done_with_the_last_step_and_stopped_groups_are_not_watched():
    p = two_ranks(max_steps=2)
    for step in (1, 2):
        p.beat(0, step, float(step))
        p.beat(1, step, float(step))
    assert p.stalled(1000.0) is None  # the final save may take long
    p = two_ranks()
    p.stop()  # the group shut down (a restart): its ranks are gone
    p.beat(0, 1, 5.0)  # a late beat of the old group is ignored
    assert p.stalled(1000.0) is None and p.ranks == {}


def test_a_rank_reports_each_step_and_times_steps_from_its_restore():
    beats: list[int] = []
    hook = StepBeat(beats.append)
    hook.after_step(1)
    hook.restored()
    hook.after_step(2)
    assert beats == [1, 2] and len(hook.step_times) == 2 and hook.median_step_s >= 0.0


def test_a_process_stopped_for_the_liveness_bound_is_dead_long_before_its_start_bound():
    """A 20-minute start bound, a 45 s liveness bound: rank 1 stopped (SIGSTOP, state T) from 10 s into its
    start is dead at 55 s; a slow rank (sleeping, S) or one found running again in between is not."""
    p = Progress(0.0, 1200.0, 30, liveness_timeout_s=45.0)
    p.watch({0: (100, "n0"), 1: (101, "n1")}, now=0.0)
    for t in range(0, 55, 5):
        assert p.dead({0: "S", 1: "T" if t >= 10 else "R"}, float(t)) is None
    stall = p.dead({0: "S", 1: "T"}, 55.0)
    assert stall is not None and stall.liveness and (stall.ranks, stall.step, stall.bound_s) == ([1], None, 45.0)
    assert p.stalled(55.0) is None  # the progress bounds alone would wait 1200 s

    p = Progress(0.0, 1200.0, 30, liveness_timeout_s=45.0)
    p.watch({0: (100, "n0")}, now=0.0)
    assert p.dead({0: "T"}, 0.0) is None and p.dead({0: "R"}, 30.0) is None  # running again: starts over
    assert p.dead({0: "T"}, 40.0) is None and p.dead({0: None}, 80.0) is None  # a silent node counts as down
    assert p.dead({0: None}, 85.0) is not None
