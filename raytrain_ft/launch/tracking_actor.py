"""The run's MLflow client in one Ray actor that lives as long as the job, not in the training workers.

A restarted worker group would otherwise open MLflow again on rank 0 at every attempt: importing
MLflow and opening its store (for SQLite, SQLAlchemy and a schema check) costs ~1.7 s of CPU on
the recovery's critical path (benchmarks/goodput.py, "Where the recovery seconds go"). The driver
starts one `TrackingActor` per submission on its own node (`start_tracking_actor`; 0 CPU; it
reaches the same tracking URI as the driver, which `raytrain_ft.launch.tracking_server` makes
reachable from every node); workers get its handle and log through `RemoteRunLogger`.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

if TYPE_CHECKING:
    from raytrain_ft.tracking import RunLogger

# Calls whose caller uses the result or must know it landed: the proxy waits for these.
WAITED = frozenset({"events", "run_start", "latest_metrics", "hang", "timeline.registered"})
WAIT_TIMEOUT_S = 120.0


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class TrackingActor:
    """Holds the `RunLogger` of the current attempt; runs callers' calls in the order each made them
    (Ray orders one caller's tasks to a synchronous actor)."""

    def __init__(self, uri: str, run_id: str):
        from raytrain_ft.tracking import RunLogger  # MLflow: imported here, in this actor only

        self.open = lambda: RunLogger(uri, run_id)
        self.logger: RunLogger = self.open()

    def new_attempt(self) -> None:
        """A fresh logger (fresh step timeline) for a new attempt, once the previous attempt's
        queued values reached MLflow: the new attempt sorts them from there (`StepTimeline.recover`)."""
        self.logger.timeline.drain()
        self.logger = self.open()

    def call(self, path: str, args: tuple, kwargs: dict) -> Any:
        """`self.logger.<path>(*args, **kwargs)`; `path` is a method name or `timeline.<method>`."""
        target: Any = self.logger
        for name in path.split("."):
            target = getattr(target, name)
        return target(*args, **kwargs)

    def close(self) -> None:
        """Wait until every queued step value is logged."""
        self.logger.timeline.drain()


def start_tracking_actor(uri: str, run_id: str) -> ray.actor.ActorHandle:
    """The run's `TrackingActor`, on the driver's node: the head on a cluster (`ray job submit`),
    which outlives the worker nodes that come and go (a preempted node would take the actor and
    its queued values with it)."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return TrackingActor.options(scheduling_strategy=here).remote(uri, run_id)  # type: ignore[attr-defined]


def close(actor: ray.actor.ActorHandle, timeout_s: float = 60.0) -> None:
    """End `actor` once the step values queued there are logged (at most `timeout_s` seconds).
    Never raises: it runs on the driver's way out, after a failure too."""
    with contextlib.suppress(ray.exceptions.RayError, TimeoutError):  # what was not logged is lost with it
        ray.get(actor.close.remote(), timeout=timeout_s)
    with contextlib.suppress(ray.exceptions.RayError, ValueError):
        ray.kill(actor)


class RemoteRunLogger:
    """`RunLogger`'s interface, each call run by a `TrackingActor`. Calls return at once, so a slow
    tracking server never blocks a step, except the `WAITED` ones, those passed `wait=True`, and
    all of them under `wait_all`, which wait at most `timeout_s` (then
    `ray.exceptions.GetTimeoutError`: a hung rank's watchdog still exits, an attempt start fails
    and Ray restarts it). Errors of calls not waited
    for are not raised here: Ray logs them ("unhandled error"), like the in-process logger's
    warnings; tracking is not worth a failed training run. Events are stamped with the caller's
    clock (`time`), not the actor's."""

    def __init__(
        self, actor: ray.actor.ActorHandle, prefix: str = "", wait_all: bool = False, timeout_s: float = WAIT_TIMEOUT_S
    ):
        self._actor, self._prefix, self._wait_all, self._timeout_s = actor, prefix, wait_all, timeout_s

    def __getattr__(self, name: str):
        if name.startswith("_"):  # copy, pickle and friends probe dunders: not logger methods
            raise AttributeError(name)
        if name == "timeline":
            return RemoteRunLogger(self._actor, "timeline.", self._wait_all, self._timeout_s)
        path = self._prefix + name

        def call(*args, **kwargs):
            if path == "event":
                kwargs.setdefault("time", time.time())
            ref = self._actor.call.remote(path, args, kwargs)
            waited = self._wait_all or path in WAITED or kwargs.get("wait")
            return ray.get(ref, timeout=self._timeout_s) if waited else None

        return call
