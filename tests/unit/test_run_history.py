"""The run history the loop decides with (`recovery.RunHistory`) and the recorder interface it
records through (`raytrain_ft.core.recorder`): every implementation implements all of it."""

from __future__ import annotations

from raytrain_ft.core.recorder import NullRecorder, Recorder
from raytrain_ft.launch.recorder_actor import RemoteRecorder
from raytrain_ft.resilience.recovery import RunHistory
from raytrain_ft.telemetry.tracking import MlflowRecorder


def test_the_history_keeps_the_control_events_in_time_order_without_rays_full_text():
    history = RunHistory.of(
        100.0,
        [
            {"time": 130.0, "kind": "attempt_start", "resumed_from": 10},
            {"time": 120.0, "kind": "failure", "causes": {"1": "x"}, "details": {"1": "long"}, "last_step": 11},
            # the next group lost a worker while it started: a restart of its own (`recovery.failures`)
            {
                "time": 121.0,
                "kind": "failure",
                "source": "group_start",
                "causes": {"group_start": "x"},
                "last_step": 11,
            },
            {"time": 125.0, "kind": "first_step", "step": 1},  # not a control event
            {"time": 110.0, "kind": "attempt_start", "resumed_from": 0},
        ],
    )
    assert [(e["time"], e["kind"]) for e in history.events] == [
        (110.0, "attempt_start"),
        (120.0, "failure"),
        (121.0, "failure"),
        (130.0, "attempt_start"),
    ]
    assert "details" not in history.events[1] and history.run_start == 100.0
    assert history.failure_times() == [120.0, 121.0]  # one failure event per restart
    history.record({"time": 115.0, "kind": "hang", "stalled_s": 3.0})  # a late report sorts into place
    history.record({"time": 140.0, "kind": "skipped_step", "step": 12})
    assert [e["time"] for e in history.events] == [110.0, 115.0, 120.0, 121.0, 130.0]
    assert history.attempt_starts() == [110.0, 130.0]


def test_every_recorder_implements_the_whole_interface():
    methods = set(Recorder.__abstractmethods__)
    assert {"metrics", "tags", "event", "hang", "record_step", "registered", "goodput"} <= methods
    for implementation in (NullRecorder, RemoteRecorder, MlflowRecorder):
        assert not implementation.__abstractmethods__, implementation  # instantiable: nothing left abstract
        assert all(m in vars(implementation) for m in methods), implementation  # each method its own, explicitly
