"""Ray Train controller callbacks: acknowledge commits (`CommitAcknowledger`); record each worker-group failure
in the run history and hand a worker lost while the group is set up to the driver (`FailureRecorder`);
tell the driver's progress watchdog which processes to watch (`WatchRanks`)."""

from __future__ import annotations

import logging
import re

import ray
from ray.exceptions import RayActorError
from ray.train import ControllerError, UserCallback, WorkerGroupError

from raytrain_ft.core.run_folder import write_commit_ack
from raytrain_ft.launch.group_start import baseline_resources, short, start_timeout_s
from raytrain_ft.launch.progress_watchdog import stopped_causes
from raytrain_ft.launch.ray_internals import (
    ControllerCallback,
    ErroredState,
    ReschedulingState,
    RestartingState,
    WorkerGroupCallback,
    WorkerGroupStartupFailedError,
    WorkerGroupStartupTimeoutError,
)
from raytrain_ft.launch.recorder_actor import RemoteRecorder
from raytrain_ft.resilience.recovery import CONSEQUENCE, GROUP_START, KILLED, cause_text

log = logging.getLogger(__name__)
TRACKING_TIMEOUT_S = 30.0  # the controller waits this long for each tracking call, then restarts without it


def describe(exc: BaseException) -> str:
    """`ExceptionType: first line of the message` of the innermost cause Ray reports."""
    exc = innermost(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:500]


def innermost(exc: BaseException) -> BaseException:
    while (cause := getattr(exc, "cause", None)) is not None and cause is not exc:
        exc = cause
    return exc


# What Ray reports for a worker process that died without raising (SIGKILL, the OOM killer, os._exit):
# the raylet sees the connection drop, not the signal or exit status.
_DIED = re.compile(r"worker process has died|Worker unexpectedly exits")
_EXIT_CODE = re.compile(r"exit(?:ed|s)? with (?:an )?exit code (-?\d+)", re.I)
_TIMEOUT = re.compile(r"(?:timed out|timeout)\D{0,40}?(\d+(?:\.\d+)?)\s*(ms|milliseconds|s|seconds)\b", re.I)
_PEER_LOST = re.compile(
    r"Connection (?:reset|closed) by peer|Broken pipe|Socket closed|remote process exited|"
    r"\[[^]]*gloo[^]]*\] (?:Read|Write) error",
    re.I,
)


def plain_cause(exc: BaseException) -> str:
    """One short phrase for a rank's failure, for the recovery history and the job's last line.

    "killed (SIGKILL, OOM killer or os._exit: the process died without an exception)",
    "exited with code N", "collective timed out after N s", `CONSEQUENCE` (this rank lost its
    connection to a peer that failed first), else "ExceptionType: message" (`describe`).
    """
    text = str(innermost(exc))
    if m := _EXIT_CODE.search(text):
        return f"exited with code {m.group(1)}"
    if _DIED.search(text):
        return KILLED
    if _PEER_LOST.search(text):
        return CONSEQUENCE
    if (m := _TIMEOUT.search(text)) and ("collective" in text.lower() or "gloo" in text or "NCCL" in text):
        seconds = float(m.group(1)) / (1000 if m.group(2).lower().startswith("m") else 1)
        return f"collective timed out after {seconds:g} s"
    return describe(exc)


class CommitAcknowledger(UserCallback):
    """Runs on the controller: on every registered checkpoint, writes its path to
    `<run folder>/last_commit_ack`, so a worker can wait until Ray has registered a commit
    (`RaySession.flush`)."""

    def __init__(self, run_root: str):
        self.run_root = run_root

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if checkpoint is not None:
            write_commit_ack(self.run_root, checkpoint.path)


def decided_failure(state) -> dict[int, Exception] | None:
    """The ranks' errors (rank -> Ray's error) when the controller's new `state` is its decision on a
    worker-group failure: restart (`RestartingState`) or end the run (`ErroredState`); else None."""
    error = getattr(state, "training_failed_error", None)
    if isinstance(state, (RestartingState, ErroredState)) and isinstance(error, WorkerGroupError):
        return error.worker_failures
    return None


def start_timed_out(state) -> int | None:
    """The number of workers of a group start that found no resources within Ray Train's wait
    (`WorkerGroupStartupTimeoutError`) when the controller's new `state` retries it; else None."""
    error = getattr(state, "training_failed_error", None)
    failure = getattr(error, "controller_failure", None)
    if isinstance(state, ReschedulingState) and isinstance(failure, WorkerGroupStartupTimeoutError):
        return failure.num_workers
    return None


def start_timeout_cause(num_workers: int, free: dict[str, float]) -> str:
    """The failure line of a start that got no resources: how many workers, the bound and its key, what
    was free (`free`: the cluster's free resources)."""
    return (
        f"no resources for the worker group of {num_workers} workers within {start_timeout_s():g} s "
        f"(failure.group_start_timeout_s); free in the cluster: {short(free)}"
    )


def lost_in_setup(state) -> RayActorError | None:
    """The dead worker actor's error when the controller's new `state` retries a group start that
    failed because a worker actor died during the setup (`WorkerGroupStartupFailedError` from a
    `RayActorError`); else None (a start that timed out waiting for resources is Ray's to retry)."""
    error = getattr(state, "training_failed_error", None)
    if not isinstance(state, ReschedulingState) or not isinstance(error, ControllerError):
        return None
    failure = error.controller_failure
    if isinstance(failure, WorkerGroupStartupFailedError) and isinstance(failure.__cause__, RayActorError):
        return failure.__cause__
    return None


class FailureRecorder(ControllerCallback):
    """Runs on the controller, at each of its state changes.

    Each failure of the worker group that Ray Train decides on (a `WorkerGroupError`: the controller
    moves to `RestartingState`, or to `ErroredState` when no restart is left) becomes one `failure`
    event: the short cause per rank (`plain_cause`) as a tag and in the event, Ray's full text per rank
    under `details` (`raytrain_ft.resilience.recovery` turns the events into the recovery history and the `restarts`
    metric when the next attempt starts). One event per decision, however many polls reported the
    ranks' errors and whether or not the attempt got as far as its restore: every restart is counted
    once, as Ray Train counts it against `max_failures`.

    A worker actor that dies while Ray Train sets the worker group up (creating the actors, the
    process group, the train context) ends the controller's run with that actor's `RayActorError`, for
    the driver to record and resume (`driver.failed_during_group_start`). Ray Train 2.60 wraps that
    death in `WorkerGroupStartupFailedError`, a controller error it retries (`ReschedulingState`)
    counted only against `controller_failure_limit` (unlimited by default), not `max_failures`: the
    restart would be counted nowhere, and a worker that dies at every start would restart the group
    forever. A death a moment later, while Ray launches the train function, already ends the run with
    the actor's error (`ControllerError(ActorDiedError)`): both take the same path.

    It records through the run's `RecorderActor` (`recorder_actor`), not an MLflow client of its own: Ray
    Train ships the `RunConfig`, and with it this callback, to every worker at every worker-group
    start, and unpickling it there imports this module; MLflow's import alone cost each restarted
    worker ~0.8 s (`test_training_workers_do_not_import_mlflow`). Each record waits (at most
    `TRACKING_TIMEOUT_S`), so the failure is in the run history before the next attempt reads it; a
    tracking error is logged and never decides whether Ray restarts the group (Ray Train ends the
    run on an exception from a callback).

    A rank the driver's progress watchdog stopped (`watchdog`, `launch.progress_watchdog`) died of a
    SIGKILL, but its cause is the stall: the watchdog's cause replaces Ray's for that rank.

    Under `failure.recovery: replica` (`replicas`: the run's number of replicas, else 0) Ray Train
    replaces only the failed replicas when some replicas are still healthy (it restarts every one
    when all failed): such a failure's event also lists the replaced ranks (`replaced`), which makes
    it a replacement in the recovery history (`recovery.replacement_rows`), not a restart.
    """

    def __init__(
        self, recorder_actor: ray.actor.ActorHandle, replicas: int = 0, watchdog: ray.actor.ActorHandle | None = None
    ):
        self.recorder_actor, self.replicas, self.watchdog = recorder_actor, replicas, watchdog

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if (worker_exceptions := decided_failure(current_state)) is not None:
            self.record(worker_exceptions, restarting=isinstance(current_state, RestartingState))
        elif (lost := lost_in_setup(current_state)) is not None:
            raise lost  # Ray Train: ControllerError(RayActorError), not retried: fit() raises it
        elif (num_workers := start_timed_out(current_state)) is not None:
            cause = start_timeout_cause(num_workers, baseline_resources())
            log.warning("group start failed: %s", cause)
            self._event({GROUP_START: cause}, {GROUP_START: str(current_state.training_failed_error)}, GROUP_START)

    def record(self, worker_exceptions: dict[int, Exception], restarting: bool = True) -> None:
        """The `failure` event of one worker-group failure (`worker_exceptions`: rank -> Ray's error;
        `restarting`: Ray Train goes on, else the run ends)."""
        causes = {str(rank): plain_cause(e) for rank, e in sorted(worker_exceptions.items())}
        causes.update({str(r): c for r, c in self.stopped_by_watchdog().items() if r in worker_exceptions})
        partial = restarting and 0 < len(worker_exceptions) < self.replicas
        details = {str(rank): str(e) for rank, e in worker_exceptions.items()}  # Ray's full text
        self._event(causes, details, replaced=sorted(worker_exceptions) if partial else None)

    def _event(
        self, causes: dict[str, str], details: dict[str, str], source: str = "", replaced: list[int] | None = None
    ) -> None:
        # Ray restarts the group only after this returns: one read, one tag write, one event file.
        try:
            recorder = RemoteRecorder(self.recorder_actor, wait=True, timeout_s=TRACKING_TIMEOUT_S)
            latest = recorder.latest_metrics()
            recorder.tags({"last_failure_cause": cause_text(causes)})
            recorder.event(
                "failure",
                **({"replaced": replaced} if replaced else {}),
                **({"source": source} if source else {}),
                causes=causes,
                details={k: v[:20000] for k, v in details.items()},
                last_step=int(latest.get("last_step", 0)),
                step_time_s=latest.get("current_step_time_s", 0.0),
                world_size=int(latest.get("world_size", 0)),
            )
        except Exception as e:  # the restart goes on without this record
            log.warning("failure (%s) not recorded in MLflow: %s", cause_text(causes), e)

    def stopped_by_watchdog(self) -> dict[int, str]:
        """{rank: cause} of the ranks the progress watchdog stopped (`launch.progress_watchdog`): their
        cause is the stall, not the SIGKILL that ended them."""
        return {} if self.watchdog is None else stopped_causes(self.watchdog)


class WatchRanks(WorkerGroupCallback):
    """Runs in Ray Train's controller: the ranks, pids and nodes of every worker process Ray Train
    creates go to the `ProgressWatchdog` before their train context is initialized (a group start, a
    replica's replacement); a shutdown or abort of the group stops the watch."""

    def __init__(self, watchdog: ray.actor.ActorHandle):
        self.watchdog = watchdog

    def before_init_train_context(self, workers) -> dict:
        ranks = {w.distributed_context.world_rank: (w.metadata.pid, w.metadata.node_id) for w in workers}
        self.watchdog.watch.remote(ranks)
        return {}

    def before_worker_group_shutdown(self, worker_group) -> None:
        self.watchdog.stop.remote()

    def before_worker_group_abort(self, worker_group_context) -> None:
        self.watchdog.stop.remote()
