"""Ray Train controller callback: records each worker-group failure in MLflow and acknowledges commits."""

from __future__ import annotations

import logging
import re

import ray
from ray.train.v2.api.callback import UserCallback

from raytrain_ft.launch.recorder_actor import RemoteRecorder
from raytrain_ft.recovery import CONSEQUENCE, KILLED, cause_text
from raytrain_ft.run_folder import write_commit_ack

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


class ControllerCallback(UserCallback):
    """Runs on the controller.

    On every failure: the short cause per rank (`plain_cause`) as a tag and a `failure` event (with
    Ray's full text per rank under `details`) (`raytrain_ft.recovery` turns the
    events into the recovery history and the `restarts` metric when the next attempt starts). On every registered
    checkpoint: its path is written to `<run folder>/last_commit_ack`, so a worker can wait until
    Ray has registered a commit (`RaySession.flush`).

    It records through the run's `RecorderActor` (`recorder_actor`), not an MLflow client of its own: Ray
    Train ships the `RunConfig`, and with it this callback, to every worker at every worker-group
    start, and unpickling it there imports this module; MLflow's import alone cost each restarted
    worker ~0.8 s (`test_training_workers_do_not_import_mlflow`). Each call waits (at most
    `TRACKING_TIMEOUT_S`), so the failure is in the run history before the next attempt reads it; a
    tracking error is logged and never decides whether Ray restarts the group (Ray Train ends the
    run on an exception from a callback).
    """

    def __init__(self, recorder_actor: ray.actor.ActorHandle, run_root: str):
        self.recorder_actor, self.run_root = recorder_actor, run_root

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if checkpoint is not None:
            write_commit_ack(self.run_root, checkpoint.path)

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        # Ray restarts the group only after this returns: one read, one tag write, one event file.
        causes = {str(rank): plain_cause(e) for rank, e in sorted(worker_exceptions.items())}
        try:
            recorder = RemoteRecorder(self.recorder_actor, wait=True, timeout_s=TRACKING_TIMEOUT_S)
            latest = recorder.latest_metrics()
            recorder.tags({"last_failure_cause": cause_text(causes)})
            recorder.event(
                "failure",
                causes=causes,
                details={str(rank): str(e)[:20000] for rank, e in worker_exceptions.items()},  # Ray's full text
                last_step=int(latest.get("last_step", 0)),
                step_time_s=latest.get("current_step_time_s", 0.0),
                world_size=int(latest.get("world_size", 0)),
            )
        except Exception as e:  # the restart goes on without this record
            log.warning("failure (%s) not recorded in MLflow: %s", cause_text(causes), e)
