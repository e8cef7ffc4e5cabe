"""Ray Train controller callback: records each worker-group failure in MLflow and acknowledges commits."""

from __future__ import annotations

import fsspec
from ray.train.v2.api.callback import UserCallback

from raytrain_ft.tracking import RunLogger


def describe(exc: BaseException) -> str:
    """`ExceptionType: first line of the message` of the innermost cause Ray reports."""
    while getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc = exc.cause
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:500]


COMMIT_ACK_FILE = "last_commit_ack"


class RunRecorder(UserCallback):
    """Runs on the controller.

    On every failure: the cause as a tag and a `failure` event (`raytrain_ft.recovery` turns the
    events into the recovery history and the `restarts` metric when the next attempt starts). On every registered
    checkpoint: its path is written to `<run folder>/last_commit_ack`, so a worker can wait until
    Ray has registered a commit (`RaySession.flush`).
    """

    def __init__(self, tracking_uri: str, run_id: str, run_root: str):
        self.tracking_uri, self.run_id, self.run_root = tracking_uri, run_id, run_root

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if checkpoint is not None:
            with fsspec.open(f"{self.run_root.rstrip('/')}/{COMMIT_ACK_FILE}", "w") as f:
                f.write(checkpoint.path)

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        logger = RunLogger(self.tracking_uri, self.run_id)
        causes = {rank: describe(e) for rank, e in sorted(worker_exceptions.items())}
        logger.tags({"last_failure_cause": "; ".join(f"rank {r}: {c}" for r, c in causes.items())})
        logger.event(
            "failure",
            causes={str(r): c for r, c in causes.items()},
            last_step=int(logger.latest("last_step")),
            step_time_s=logger.latest("current_step_time_s"),
            world_size=int(logger.latest("world_size")),
        )
