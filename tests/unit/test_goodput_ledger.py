"""Goodput: the wall-time classification of a run's events and the ledger's arithmetic (no Ray)."""

from __future__ import annotations

import pytest

from raytrain_ft.telemetry.goodput import GAP_PARTS, GoodputLedger, classify_gap

# A run created at t=0: first attempt's workers start at 5, restored at 8; a failure at 20 (the
# controller reports it twice, once per failed rank); next attempt starts at 27, restored at 30;
# a rank hangs from 40 and its watchdog fires at 50; that failure is noticed at 52; the third
# attempt starts at 55, restored at 56; classified up to 60.
TIMELINE = [
    {"kind": "attempt_start", "time": 8.0, "init_started_at": 5.0},
    {"kind": "skipped_step", "time": 12.0, "step": 3},
    {"kind": "failure", "time": 20.0},
    {"kind": "failure", "time": 21.0},
    {"kind": "attempt_start", "time": 30.0, "init_started_at": 27.0},
    {"kind": "hang", "time": 50.0, "stalled_s": 10.0},
    {"kind": "failure", "time": 52.0},
    {"kind": "attempt_start", "time": 56.0, "init_started_at": 55.0},
]


def test_a_fresh_run_with_two_failures_and_a_hang_is_classified_second_by_second():
    parts = classify_gap(list(reversed(TIMELINE)), 0.0, 60.0, fresh=True)
    assert parts == {
        "startup": 8.0,
        "lost_work": 12.0 + 10.0 + 2.0 + 4.0,
        "restart_downtime": 7.0 + 3.0,
        "restore": 3.0 + 1.0,
        "hang": 10.0,
        "checkpoint_stall": 0.0,
        "skipped_steps": 0.0,
    }
    assert sum(parts.values()) == 60.0


def test_after_a_checkpoint_only_the_time_since_its_snapshot_is_classified():
    # resumed from a checkpoint whose ledger ends at 45: the first two failures are already in it
    parts = classify_gap(TIMELINE, 45.0, 60.0, fresh=False)
    assert parts["lost_work"] == 5.0 - 5.0 + 2.0 + 4.0 and parts["hang"] == 5.0  # the hang began before 45
    assert parts["restart_downtime"] == 3.0 and parts["restore"] == 1.0 and parts["startup"] == 0.0


def test_a_rollback_turns_the_discarded_steps_into_lost_work_and_its_reload_into_restore():
    events = [{"kind": "rollback", "time": 14.0, "restore_started_at": 12.5}]
    assert classify_gap(events, 10.0, 15.0, fresh=False) == {
        **dict.fromkeys(GAP_PARTS, 0.0),
        "lost_work": 3.5,
        "restore": 1.5,
    }


def test_a_restart_without_a_failure_event_counts_the_unknown_end_of_work_as_lost_work():
    events = [{"kind": "attempt_start", "time": 30.0, "init_started_at": 27.0}]  # e.g. an elastic resize
    assert classify_gap(events, 10.0, 30.0, fresh=False) == {
        **dict.fromkeys(GAP_PARTS, 0.0),
        "lost_work": 17.0,
        "restore": 3.0,
    }


def test_the_ledger_puts_steps_and_stalls_in_their_buckets_and_round_trips():
    ledger = GoodputLedger()
    ledger.start(100.0)
    ledger.add_gap([{"kind": "attempt_start", "time": 104.0, "init_started_at": 103.0}], 104.0, fresh=True)
    ledger.add_step(105.0, stall_s=0.25, skipped=False)
    ledger.add_step(106.0, stall_s=0.0, skipped=True)
    ledger.add("checkpoint_stall", 106.5)
    summary = ledger.summary(110.0)
    assert summary["productive_s"] == 0.75 and summary["goodput"] == 0.75 / 10.0
    assert summary["badput_startup_s"] == 4.0 and summary["badput_skipped_steps_s"] == 1.0
    assert summary["badput_checkpoint_stall_s"] == 0.75 and summary["unaccounted_s"] == pytest.approx(3.5)
    copy = GoodputLedger()
    copy.load_state_dict(ledger.state_dict())
    assert copy.summary(110.0) == summary


def test_a_stall_longer_than_the_step_is_clamped_and_time_never_runs_backwards():
    ledger = GoodputLedger()
    ledger.start(0.0)
    ledger.add_step(2.0, stall_s=5.0, skipped=False)  # the stall began before the account's cursor
    assert (ledger.productive_s, ledger.badput_s["checkpoint_stall"], ledger.accounted_until) == (0.0, 2.0, 2.0)
    ledger.add_step(1.0, stall_s=0.0, skipped=False)  # a clock step back adds nothing
    ledger.add("restore", 1.5)
    assert (ledger.productive_s, ledger.badput_s["restore"], ledger.accounted_until) == (0.0, 0.0, 2.0)
    summary = ledger.summary(4.0)
    assert summary["goodput"] == 0.0 and summary["wall_s"] == 4.0 and summary["unaccounted_s"] == 2.0


def test_replica_recovery_degraded_steps_are_productive_and_the_survivors_lost_time_is_replacement():
    """Replica recovery: a peer dies during step 3 (it does not commit: 2 s into `replacement`), the
    survivor's next quorum waits 1.5 s for the lighthouse to drop it (`replacement_s` of the step
    after), the survivor trains on alone (productive); the replacement's failure event is no
    boundary of a later restart's gap."""
    ledger = GoodputLedger()
    ledger.start(0.0)
    ledger.add_step(1.0, stall_s=0.0, skipped=False)  # steps 1-2 with both replicas
    ledger.add_step(2.0, stall_s=0.0, skipped=False)
    ledger.add("replacement", 4.0)  # step 3 did not commit
    ledger.add_step(6.5, stall_s=0.0, skipped=False, replacement_s=1.5)  # step 3 again, alone
    ledger.add_step(7.5, stall_s=0.0, skipped=False)  # step 4, alone
    assert ledger.badput_s["replacement"] == 2.0 + 1.5
    assert ledger.productive_s == 1.0 + 1.0 + 1.0 + 1.0
    assert ledger.summary(7.5)["unaccounted_s"] == pytest.approx(0.0)
    # a later restart of every replica: the replacement (`replaced`) at 3.0 is not where work was lost
    events = [
        {"kind": "failure", "time": 3.0, "replaced": [1]},
        {"kind": "failure", "time": 9.0},
        {"kind": "attempt_start", "time": 12.0, "init_started_at": 11.0},
    ]
    assert classify_gap(events, 2.0, 12.0, fresh=False) == {
        **dict.fromkeys(GAP_PARTS, 0.0),
        "lost_work": 7.0,
        "restart_downtime": 2.0,
        "restore": 1.0,
    }
