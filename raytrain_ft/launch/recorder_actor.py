"""The run's MLflow client in one Ray actor that lives as long as the job, not in the training workers.

A restarted worker group would otherwise open MLflow again on rank 0 at every attempt: importing
MLflow and opening its store (for SQLite, SQLAlchemy and a schema check) costs ~1.7 s of CPU on
the recovery's critical path (benchmarks/goodput.py, "Where the recovery seconds go"). The driver
starts one `RecorderActor` per submission on its own node (`start_recorder_actor`; 0 CPU; it
reaches the same tracking URI as the driver, which `raytrain_ft.launch.tracking_server` makes
reachable from every node); rank 0, the controller callback and the driver record through a
`RemoteRecorder`, the `Recorder` interface with each call run by the actor. The actor also keeps
the run's `RunHistory` (`raytrain_ft.resilience.recovery`) that workers read through `RaySession.history`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ft.core.recorder import Recorder
from raytrain_ft.resilience.recovery import RunHistory

if TYPE_CHECKING:
    from raytrain_ft.telemetry.tracking import MlflowRecorder

WAIT_TIMEOUT_S = 120.0  # a caller's wait for the actor (which answers without waiting on the store)
log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class RecorderActor:
    """Holds the `MlflowRecorder` of the current attempt and the run's `RunHistory`; runs callers'
    calls in the order each made them (Ray orders one caller's tasks to a synchronous actor).

    The history is loaded from the store when the actor starts (once per submission, or after the
    actor itself restarted) and then kept up to date by every event recorded here."""

    def __init__(self, uri: str, run_id: str, timeout_s: float = 30.0):
        from raytrain_ft.telemetry.outbox import Outbox, bound_requests  # MLflow: in this actor only
        from raytrain_ft.telemetry.tracking import MlflowRecorder

        bound_requests(timeout_s)  # each request gives up after `timeout_s`; the outbox retries
        first = MlflowRecorder(uri, run_id, timeout_s=timeout_s)
        self.run_history: RunHistory = first.load_history()
        self.latest: dict[str, float] = first.latest_metrics()  # then kept here: no read waits on the store
        outbox = Outbox()  # every attempt's records, in order, held while the store is unreachable
        self.open = lambda: MlflowRecorder(uri, run_id, self.run_history, outbox, timeout_s)
        self.recorder: MlflowRecorder = self.open()

    def new_attempt(self) -> None:
        """A fresh recorder (fresh step timeline) for a new attempt; the previous attempt's records
        are sent first (one outbox), so the new attempt sorts them from there (`resume_timeline`)."""
        self.recorder = self.open()

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        """`self.recorder.<method>(*args, **kwargs)`, `method` one of the `Recorder` interface's."""
        if method not in Recorder.__abstractmethods__:
            raise AttributeError(f"{method} is not a Recorder method")
        if method == "metrics":
            self.latest.update(args[1])
        elif method == "record_step":
            self.latest.update(args[2])  # `current`: last_step, current_step_time_s, ...
        return getattr(self.recorder, method)(*args, **kwargs)

    def latest_metrics(self) -> dict[str, float]:
        """Each metric's latest value: the store's when the actor started, then what was recorded
        here since ({key: value}; answered without the store)."""
        return dict(self.latest)

    def history(self) -> RunHistory:
        return self.run_history

    def held(self) -> int:
        """Records not yet taken by the tracking store (`outbox.Outbox.held`)."""
        return self.recorder.outbox.held()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every record is sent (at most `timeout_s`); True if none is left."""
        return self.recorder.drain(timeout_s)


def start_recorder_actor(uri: str, run_id: str, timeout_s: float = 30.0) -> ray.actor.ActorHandle:
    """The run's `RecorderActor`, on the driver's node: the head on a cluster (`ray job submit`),
    which outlives the worker nodes that come and go (a preempted node would take the actor and
    its queued values with it). `timeout_s`: each MLflow request's bound (`waits.tracking_timeout_s`)."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return RecorderActor.options(scheduling_strategy=here).remote(uri, run_id, timeout_s)  # type: ignore[attr-defined]


def close(actor: ray.actor.ActorHandle, timeout_s: float = 60.0) -> None:
    """End `actor` once the records held there are sent (at most `timeout_s` seconds: what is held
    then is lost with the actor, one line says how much).
    Never raises: it runs on the driver's way out, after a failure too."""
    with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
        if not ray.get(actor.drain.remote(timeout_s), timeout=timeout_s + 10):
            log.warning("the tracking store did not take %d records before the job ended", ray.get(actor.held.remote()))
    with contextlib.suppress(ray.exceptions.RayError, ValueError):
        ray.kill(actor)


class RemoteRecorder(Recorder):
    """The `Recorder` interface, each call run by a `RecorderActor`. Calls return at once, so a slow
    tracking server never blocks a step, except `hang`, `registered`, `refresh_loss_plot(wait=True)`,
    `latest_metrics` and, with `wait`, all of them: those wait at most `timeout_s` (then
    `ray.exceptions.GetTimeoutError`: the progress watchdog still stops a stalled rank, an attempt start fails
    and Ray restarts it). Errors of calls not waited for are not raised here: Ray logs them
    ("unhandled error"), like the in-process recorder's warnings; tracking is not worth a failed
    training run. Events are stamped with the caller's clock (`time`), not the actor's."""

    def __init__(self, actor: ray.actor.ActorHandle, wait: bool = False, timeout_s: float = WAIT_TIMEOUT_S):
        self._actor, self._wait, self._timeout_s = actor, wait, timeout_s

    def _call(self, method: str, *args: object, kwargs: dict | None = None, waited: bool = False) -> Any:
        ref = self._actor.call.remote(method, args, kwargs or {})
        return ray.get(ref, timeout=self._timeout_s) if waited or self._wait else None

    def metrics(self, step: int, values: dict[str, float]) -> None:
        self._call("metrics", step, values)

    def tags(self, values: dict[str, str]) -> None:
        self._call("tags", values)

    def event(self, kind: str, **fields: object) -> None:
        self._call("event", kind, kwargs={"time": time.time(), **fields})

    def hang(self, ranks: list[int], step: int | None, dump: str, stalled_s: float) -> None:
        self._call("hang", ranks, step, dump, stalled_s, waited=True)

    def record_step(self, step: int, values: dict[str, float], current: dict[str, float], at: float) -> None:
        self._call("record_step", step, values, current, at)

    def committed(self, step: int) -> None:
        self._call("committed", step)

    def registered(self) -> None:
        self._call("registered", waited=True)

    def discard_after(self, step: int) -> None:
        self._call("discard_after", step)

    def resume_timeline(self, resumed_from: int, attempt_starts: list[float]) -> None:
        self._call("resume_timeline", resumed_from, attempt_starts)

    def goodput(self, step: int, summary: dict[str, float], final: bool = False) -> None:
        self._call("goodput", step, summary, final)

    def refresh_loss_plot(self, wait: bool = False) -> None:
        self._call("refresh_loss_plot", wait, waited=wait)

    def write_recovery_tables(self) -> None:
        self._call("write_recovery_tables")

    def latest_metrics(self) -> dict[str, float]:
        """Each metric's latest value in the store (waits)."""
        return ray.get(self._actor.latest_metrics.remote(), timeout=self._timeout_s)
