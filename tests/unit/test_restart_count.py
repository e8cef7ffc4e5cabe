"""Counting restarts when a worker is lost while the group restarts: the events alone, and which of Ray
Train's controller states are a failure to record (Ray's own state and error objects, no cluster)."""

from __future__ import annotations

from ray.exceptions import ActorDiedError
from ray.train import ControllerError, WorkerGroupError
from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError, WorkerGroupStartupTimeoutError
from ray.train.v2._internal.execution.controller.state import (
    ErroredState,
    FinishedState,
    ReschedulingState,
    RestartingState,
    RunningState,
    ShuttingDownState,
)

from raytrain_ft.launch.callbacks import decided_failure, lost_in_setup, start_timed_out, start_timeout_cause
from raytrain_ft.launch.driver import _record_group_start_failure, failed_during_group_start
from raytrain_ft.launch.group_start import START_TIMEOUT_ENV
from raytrain_ft.resilience.recovery import CONSEQUENCE, GROUP_START, KILLED, failures, recovery_rows, totals


def failure(t: float, causes: dict, **fields) -> dict:
    return {
        "time": t,
        "kind": "failure",
        "causes": causes,
        "last_step": 6,
        "step_time_s": 0.5,
        "world_size": 2,
        **fields,
    }


def attempt_start(t: float, resumed_from: int) -> dict:
    return {"time": t, "kind": "attempt_start", "resumed_from": resumed_from, "world_size": 2}


def test_every_failure_is_a_restart_even_one_that_struck_before_its_attempt_restored():
    # rank 1 killed at step 6; the next group loses a worker while it starts (the driver's record); the
    # one after loses rank 0 while it loads the checkpoint; the fourth resumes from step 5
    group_start = "a worker died while the worker group started (killed)"
    events = [
        attempt_start(0.0, 0),
        failure(10.0, {"1": KILLED, "0": CONSEQUENCE}),
        failure(20.0, {GROUP_START: group_start}, source=GROUP_START),
        failure(30.0, {"0": KILLED}),
        attempt_start(40.0, 5),
    ]
    assert [i for i, _ in failures(events)] == [1, 2, 3]
    rows = recovery_rows(events)
    assert totals(rows)["restarts"] == 3
    assert [r["resumed_from"] for r in rows] == [5, 5, 5]
    assert [r["lost_steps"] for r in rows] == [1, 0, 0]  # step 6 is lost once, by the attempt that trained it
    assert [r["lost_compute_s"] for r in rows] == [0.5, 0.0, 0.0]
    assert [r["cause"] for r in rows] == [
        f"rank 1: {KILLED}; rank 0: {CONSEQUENCE}",
        f"the worker group start: {group_start}",
        f"rank 0: {KILLED}",
    ]


def test_each_failure_ray_train_decides_on_is_recorded_once():
    errors = {1: RuntimeError("killed"), 0: RuntimeError("peer lost")}
    failed = WorkerGroupError("2 workers failed", errors)
    assert decided_failure(RestartingState(failed)) == errors
    assert decided_failure(ErroredState(failed)) == errors  # no restart left: the last failure, recorded too
    # the way there is not a second record: shutting down to the error, running, finishing
    for state in (ShuttingDownState(ErroredState(failed)), RunningState(), FinishedState()):
        assert decided_failure(state) is None


def start_failed_by(cause: BaseException) -> ControllerError:
    """A `WorkerGroupStartupFailedError` raised from `cause`, as Ray Train's `_start_impl` raises it."""
    try:
        raise WorkerGroupStartupFailedError("At least one of the worker actors failed to initialize.") from cause
    except WorkerGroupStartupFailedError as e:
        return ControllerError(e)


def test_a_worker_lost_during_the_group_setup_goes_to_the_driver_and_a_start_timeout_stays_rays():
    died = ActorDiedError()
    lost = lost_in_setup(ReschedulingState(start_failed_by(died)))
    assert lost is died
    assert failed_during_group_start(ControllerError(lost))  # what fit() raises once the callback re-raised it
    assert lost_in_setup(ReschedulingState(ControllerError(WorkerGroupStartupTimeoutError(2)))) is None
    assert lost_in_setup(ReschedulingState(start_failed_by(ValueError("not an actor death")))) is None
    assert lost_in_setup(RestartingState(start_failed_by(died))) is None


def test_a_start_timeout_is_a_failure_with_its_bound_and_what_was_free(monkeypatch):
    monkeypatch.setenv(START_TIMEOUT_ENV, "30")
    assert start_timed_out(ReschedulingState(ControllerError(WorkerGroupStartupTimeoutError(2)))) == 2
    assert start_timed_out(ReschedulingState(start_failed_by(ActorDiedError()))) is None
    assert start_timed_out(RestartingState(ControllerError(WorkerGroupStartupTimeoutError(2)))) is None
    assert start_timeout_cause(2, {"CPU": 0.5, "memory": 1e9}) == (
        "no resources for the worker group of 2 workers within 30 s (failure.group_start_timeout_s); "
        "free in the cluster: {'CPU': 0.5}"
    )


class Recorded:
    """What `driver._record_group_start_failure` sends the run's recorder (no actor)."""

    def __init__(self):
        self.tagged: dict = {}
        self.events: list[dict] = []

    def latest_metrics(self) -> dict:
        return {"last_step": 5}

    def tags(self, tags: dict) -> None:
        self.tagged.update(tags)

    def event(self, kind: str, **fields) -> None:
        self.events.append({"kind": kind, **fields})


def test_a_worker_the_watchdog_stopped_inside_the_group_start_keeps_the_watchdog_cause():
    lost = ControllerError(ActorDiedError())
    stalled = "no progress for 61 s before the first step of its start (progress watchdog; stacks: x)"
    recorded = Recorded()
    _record_group_start_failure(recorded, lost, {1: stalled})  # type: ignore[arg-type]
    [event] = recorded.events
    assert event["source"] == GROUP_START and event["causes"] == {"1": f"while the worker group started: {stalled}"}
    assert recorded.tagged["last_failure_cause"] == f"rank 1: while the worker group started: {stalled}"
    plain = Recorded()
    _record_group_start_failure(plain, lost, {})  # type: ignore[arg-type]
    assert list(plain.events[0]["causes"]) == [GROUP_START]  # which rank died is not known
