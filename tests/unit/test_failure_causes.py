"""The plain cause of a rank's failure, the recovery history's rows, and the job's failure line (no Ray)."""

from __future__ import annotations

import pytest

from raytrain_ft.core.config_files import load_config
from raytrain_ft.launch.callbacks import describe, plain_cause
from raytrain_ft.launch.driver import MAX_LINE, failure_line
from raytrain_ft.resilience.faults import InjectedFault
from raytrain_ft.resilience.recovery import (
    CONSEQUENCE,
    KILLED,
    cause_text,
    guard_rows,
    recovery_rows,
    replacement_rows,
    totals,
)

# Ray 2.60's and torch 2.13's own words, captured on this machine: an actor that called os._exit
# (SIGKILL reads the same), one that called sys.exit(3), a gloo all_reduce whose peer never joined
# (init_process_group timeout 3 s), and the peer of a rank that died mid-collective.
RAY_DIED = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
    "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the "
    "worker crashed unexpectedly due to SIGSEGV or another unexpected error."
)
RAY_EXIT_3 = (
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker exits unexpectedly. Worker exits with an exit code 3."
)
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 3000ms for recv operation to complete"
)
GLOO_PEER = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:26011. This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    "error, cause",
    [
        (RuntimeError(RAY_DIED), KILLED),
        (RuntimeError(RAY_EXIT_3), "exited with code 3"),
        (RuntimeError(GLOO_TIMEOUT), "collective timed out after 3 s"),
        (RuntimeError(GLOO_PEER), CONSEQUENCE),
        (InjectedFault("injected fault at step 9 on rank 1"), "InjectedFault: injected fault at step 9 on rank 1"),
    ],
)
def test_each_way_a_rank_dies_gets_its_plain_cause(error, cause):
    assert plain_cause(error) == cause


class RayError(Exception):
    """Ray's worker errors carry the worker's exception as `.cause`."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


def test_the_cause_is_read_from_the_innermost_error_ray_wraps():
    inner = InjectedFault("injected fault at step 4 on rank 0")
    wrapped = RayError("Error(s) in the worker group:\nrank 0 failed", RayError("ActorError", inner))
    assert describe(wrapped) == "InjectedFault: injected fault at step 4 on rank 0"
    assert plain_cause(wrapped) == "InjectedFault: injected fault at step 4 on rank 0"
    assert plain_cause(RayError("outer", RuntimeError(RAY_EXIT_3))) == "exited with code 3"
    # the last line of a multi-line message; the whole text is cut at 500 characters
    assert describe(ValueError("Traceback ...\n  File x\nValueError: bad shard")) == "ValueError: ValueError: bad shard"
    assert len(describe(ValueError("x" * 1000))) == 500


def test_a_timeout_is_a_collective_timeout_only_in_a_collective_and_is_given_in_seconds():
    assert plain_cause(RuntimeError("gloo: Timed out waiting 2500ms for send")) == "collective timed out after 2.5 s"
    nccl = "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, Timeout(ms)=600000)"
    assert plain_cause(RuntimeError(nccl + " timed out after 600 seconds")) == "collective timed out after 600 s"
    assert plain_cause(TimeoutError("the data read timed out after 30 s")) == (
        "TimeoutError: the data read timed out after 30 s"
    )


def test_the_cause_text_puts_root_causes_first_and_counts_the_peers():
    assert cause_text({"0": CONSEQUENCE, "1": KILLED}) == f"rank 1: {KILLED}; rank 0: {CONSEQUENCE}"
    causes = {"3": CONSEQUENCE, "2": "exited with code 3", "0": CONSEQUENCE, "1": CONSEQUENCE}
    assert cause_text(causes) == f"rank 2: exited with code 3; ranks 0, 1, 3: {CONSEQUENCE}"
    assert cause_text({"10": "B", "9": "A"}) == "rank 9: A; rank 10: B"  # ranks in numeric order


# One run's events: attempt 1 from scratch; rank 1 killed at step 8 (its peer rank 0 lost the connection);
# attempt 2 resumes from step 5 and fails again (exit code) at step 12 with no resume yet.
EVENTS = [
    {"kind": "attempt_start", "time": 100.0, "init_started_at": 95.0, "resumed_from": 0, "world_size": 2},
    {"kind": "first_step", "time": 101.0, "first_batch_at": 100.5},
    {"kind": "skipped_step", "time": 102.0, "step": 3, "grad_norm": 99.0, "median": 1.0},
    {
        "kind": "failure",
        "time": 110.0,
        "causes": {"1": KILLED, "0": CONSEQUENCE},
        "last_step": 8,
        "step_time_s": 0.5,
        "world_size": 2,
    },
    {
        "kind": "attempt_start",
        "time": 120.0,
        "init_started_at": 116.0,
        "resumed_from": 5,
        "restored_from": "memory",
        "restore_s": 0.4,
        "world_size": 1,
    },
    {"kind": "first_step", "time": 121.5, "first_batch_at": 121.0},
    {"kind": "failure", "time": 130.0, "causes": {"0": "exited with code 3"}, "last_step": 12, "step_time_s": 0.5},
]
EVENTS[-1]["world_size"] = 1


def test_recovery_rows_give_lost_steps_and_the_phases_after_each_failure():
    rows = recovery_rows(EVENTS)
    assert rows[0] == {
        "failed_at": "1970-01-01T00:01:50+00:00",
        "cause": f"rank 1: {KILLED}; rank 0: {CONSEQUENCE}",
        "last_step": 8,
        "resumed_from": 5,
        "restored_from": "memory",
        "restore_s": 0.4,
        "lost_steps": 3,
        "lost_compute_s": 1.5,
        "group_ready_s": 6.0,
        "restored_s": 10.0,
        "first_batch_s": 11.0,
        "downtime_s": 11.5,
        "world_size_before": 2,
        "world_size_after": 1,
    }
    assert rows[1]["cause"] == "rank 0: exited with code 3"
    assert [rows[1][k] for k in ("resumed_from", "lost_steps", "lost_compute_s", "restored_s", "downtime_s")] == [
        None
    ] * 5
    assert totals(rows) == {"restarts": 2.0, "lost_steps_total": 3.0, "downtime_s_total": 11.5}
    assert guard_rows(EVENTS) == [
        {"time": "1970-01-01T00:01:42+00:00", "kind": "skipped_step", "step": 3, "detail": "grad_norm=99.0, median=1.0"}
    ]


# Replica recovery: replica 1 killed at 100 (the controller's `failure` lists it under `replaced`; its
# last step was 8; the survivor's step 9 did not commit), the survivor completes step 9 at 102.5, the
# replacement has restored checkpoint 8 at 105 and first takes part in step 14 at 110; at 200 every
# replica fails and the restart resumes from 16.
REPLICA_EVENTS = [
    {"kind": "attempt_start", "time": 10.0, "init_started_at": 5.0, "resumed_from": 0, "world_size": 1},
    {"kind": "first_step", "time": 12.0, "first_batch_at": 11.0},
    {"kind": "step_not_committed", "time": 99.9, "step": 9, "replica": 0, "participants": 2},
    {"kind": "failure", "time": 100.0, "replaced": [1], "causes": {"1": KILLED}, "last_step": 8, "step_time_s": 1.0},
    {"kind": "replica_start", "time": 105.0, "replica": 1, "resumed_from": 8},
    {"kind": "replica_joined", "time": 110.0, "replica": 1, "step": 14, "participants": 2},
    {"kind": "failure", "time": 200.0, "causes": {"0": KILLED, "1": KILLED}, "last_step": 18, "step_time_s": 1.0},
    {"kind": "attempt_start", "time": 210.0, "init_started_at": 205.0, "resumed_from": 16, "world_size": 1},
    {"kind": "first_step", "time": 212.0, "first_batch_at": 211.0},
]
for e in REPLICA_EVENTS:
    e.setdefault("world_size", 1)


def test_a_replaced_replica_is_a_replacement_row_and_not_a_restart():
    steps_done = [(8, 99.0), (9, 102.5), (10, 103.5), (14, 110.0)]
    assert replacement_rows(REPLICA_EVENTS, steps_done) == [
        {
            "failed_at": "1970-01-01T00:01:40+00:00",
            "replica": 1,
            "cause": f"rank 1: {KILLED}",
            "last_step": 8,
            "survivors_committed_s": 2.5,
            "replacement_restored_s": 5.0,
            "restored_from": 8,
            "replacement_joined_s": 10.0,
            "joined_step": 14,
            "participants": 2,
        }
    ]
    rows = recovery_rows(REPLICA_EVENTS)  # the restart of every replica only, its lost steps since 16
    assert [(r["last_step"], r["resumed_from"], r["lost_steps"], r["downtime_s"]) for r in rows] == [(18, 16, 2, 12.0)]
    assert totals(rows)["restarts"] == 1.0
    assert [r["kind"] for r in guard_rows(REPLICA_EVENTS)] == ["step_not_committed"]


class Events:
    """What `failure_line` reads from the run's logger: its events (or an unreachable store)."""

    def __init__(self, events: list[dict] | None):
        self._events = events

    def events(self) -> list[dict]:
        if self._events is None:
            raise ConnectionError("tracking store unreachable")
        return self._events


def config(name: str = "out"):
    return load_config(
        None, [f"run.name={name}", "failure.max_failures=1", "tracking.uri=sqlite:////data/runs/mlflow.db"]
    )


def test_the_failure_line_names_the_restarts_the_root_rank_its_step_and_the_cause():
    line = failure_line(config(), Events(EVENTS), started=105.0, fallback="ray said so")
    assert line == (
        "run out failed after 1/1 restarts: rank 0 after step 12: exited with code 3; "
        "details: raytrain-ft history out --tracking-uri sqlite:////data/runs/mlflow.db"
    )
    # failures of an earlier submission (before `started`) are not counted
    line = failure_line(config(), Events(EVENTS), started=125.0, fallback="ray said so")
    assert line.startswith("run out failed after 0/1 restarts: rank 0 after step 12: exited with code 3; ")


def test_without_events_the_failure_line_says_what_ray_said():
    line = failure_line(config(), Events(None), started=0.0, fallback="WorkerGroupError: 2 workers failed")
    assert line == (
        "run out failed after 0/1 restarts: WorkerGroupError: 2 workers failed; "
        "details: raytrain-ft history out --tracking-uri sqlite:////data/runs/mlflow.db"
    )


def test_a_long_cause_is_cut_so_the_line_stays_under_the_limit():
    events = [{**EVENTS[-1], "causes": {"1": "RuntimeError: " + "x" * 1000}}]
    line = failure_line(config("a" * 40), Events(events), started=0.0, fallback="")
    assert len(line) == MAX_LINE - 1 and "\n" not in line
    assert "xxx...; details: raytrain-ft history " + "a" * 40 in line
