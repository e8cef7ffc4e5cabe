"""Ray Train controller callback that records each worker-group failure in MLflow."""

from __future__ import annotations

from ray.train.v2.api.callback import UserCallback

from raytrain_ft.tracking import RunLogger


def describe(exc: BaseException) -> str:
    """`ExceptionType: first line of the message` of the innermost cause Ray reports."""
    while getattr(exc, "cause", None) is not None and exc.cause is not exc:
        exc = exc.cause
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"[:500]


class FailureRecorder(UserCallback):
    """Runs on the controller: on every failure, `restarts` += 1 and the cause as a tag and event."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.tracking_uri, self.run_id = tracking_uri, run_id

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        logger = RunLogger(self.tracking_uri, self.run_id)
        causes = {rank: describe(e) for rank, e in sorted(worker_exceptions.items())}
        restarts = int(logger.latest("restarts")) + 1
        logger.metrics(restarts, {"restarts": restarts})
        logger.tags({"last_failure_cause": "; ".join(f"rank {r}: {c}" for r, c in causes.items())})
        logger.event("failure", causes={str(r): c for r, c in causes.items()})
