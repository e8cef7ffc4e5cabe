"""What a training run records, as one typed interface: `Recorder`.

The loop, its hooks, the guards and the restore record through a `Recorder` and never read
anything back: what they decide with comes from the `Session` (`Session.history`) or the
checkpointed state. Implementations:

* `raytrain_ft.telemetry.tracking.MlflowRecorder`: the run's MLflow run (metrics, tags, event artifacts, the
  per-step timeline of `raytrain_ft.telemetry.timeline`, the loss plot, the recovery tables);
* `raytrain_ft.launch.recorder_actor.RemoteRecorder`: the same calls, run by the job's
  `RecorderActor` (which holds an `MlflowRecorder`), so Ray workers never import MLflow;
* `NullRecorder`: records nothing, for the ranks that do not log (every rank but 0);
* `Gated`: another recorder's calls, made only while a condition holds (under replica recovery a
  replica records a step's metrics only when it is the step's participant of rank 0).

This module imports no MLflow: the training workers import it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol


class Recorder(ABC):
    """What a run records. Times are unix seconds, steps optimizer steps (the run's count).

    Calls return without waiting for the store (except `hang` and `registered`, which wait until
    recorded, at most `waits.tracking_timeout_s` and not while the store is unreachable: records are
    then held and sent when it answers, `outbox.Outbox`); a failure to record is logged, never
    raised: tracking is not worth a failed run.
    """

    @abstractmethod
    def metrics(self, step: int, values: dict[str, float]) -> None:
        """Log `values` at `step` now (per-step training metrics go through `record_step`)."""

    @abstractmethod
    def tags(self, values: dict[str, str]) -> None:
        """Set the run's tags (values are cut to the store's limit)."""

    @abstractmethod
    def event(self, kind: str, **fields: object) -> None:
        """Record an event `{"time", "kind", **fields}`; `time` defaults to now (the caller's clock).
        Kinds: `raytrain_ft.resilience.recovery` (failure, attempt_start, first_step, hang, rollback, ...)."""

    @abstractmethod
    def hang(self, ranks: list[int], step: int | None, dump: str, stalled_s: float) -> None:
        """Every worker's stacks (`dump`, text) when `ranks` stalled after `step` (None: before the first
        step of their start), and a `hang` event
        (`stalled_s`: seconds since their last progress). Waits until recorded: the progress watchdog
        stops those ranks right after."""

    @abstractmethod
    def record_step(self, step: int, values: dict[str, float], current: dict[str, float], at: float) -> None:
        """One step's metrics (`raytrain_ft.telemetry.timeline`: live now, kept once a checkpoint covers the
        step); `current` values are logged at step 0 (the latest value: `last_step`, ...)."""

    @abstractmethod
    def committed(self, step: int) -> None:
        """A checkpoint at `step` was committed (the kept timeline advances)."""

    @abstractmethod
    def registered(self) -> None:
        """The runtime confirmed every commit: publish every committed step; waits until sent."""

    @abstractmethod
    def discard_after(self, step: int) -> None:
        """A rollback to the checkpoint at `step`: the recorded steps after it are discarded."""

    @abstractmethod
    def resume_timeline(self, resumed_from: int, attempt_starts: list[float]) -> None:
        """At an attempt's start: sort the previous attempt's per-step values into kept and
        discarded (`attempt_starts`: every attempt's start so far, this one last)."""

    @abstractmethod
    def goodput(self, step: int, summary: dict[str, float], final: bool = False) -> None:
        """The goodput summary (`GoodputLedger.summary`) as metrics at `step`; `final`: also as an artifact."""

    @abstractmethod
    def refresh_loss_plot(self, wait: bool = False) -> None:
        """Re-render the loss plot in the background (rate-limited); `wait` renders now and blocks."""

    @abstractmethod
    def write_recovery_tables(self) -> None:
        """Rebuild the recovery history and guard tables from the run's events."""


class NullRecorder(Recorder):
    """Records nothing: the recorder of every rank but 0, so the loop calls it without a branch."""

    def metrics(self, step: int, values: dict[str, float]) -> None:
        pass

    def tags(self, values: dict[str, str]) -> None:
        pass

    def event(self, kind: str, **fields: object) -> None:
        pass

    def hang(self, ranks: list[int], step: int | None, dump: str, stalled_s: float) -> None:
        pass

    def record_step(self, step: int, values: dict[str, float], current: dict[str, float], at: float) -> None:
        pass

    def committed(self, step: int) -> None:
        pass

    def registered(self) -> None:
        pass

    def discard_after(self, step: int) -> None:
        pass

    def resume_timeline(self, resumed_from: int, attempt_starts: list[float]) -> None:
        pass

    def goodput(self, step: int, summary: dict[str, float], final: bool = False) -> None:
        pass

    def refresh_loss_plot(self, wait: bool = False) -> None:
        pass

    def write_recovery_tables(self) -> None:
        pass


class Turn(Protocol):
    """Whether this rank records now (the loop's step members: `StepMembers.records`)."""

    @property
    def records(self) -> bool: ...


class Gated(Recorder):
    """`inner`'s calls, made only while `turn.records` (else dropped, as a `NullRecorder` would)."""

    def __init__(self, inner: Recorder, turn: Turn):
        self.inner, self.turn = inner, turn

    def when(self) -> bool:
        return self.turn.records

    def metrics(self, step: int, values: dict[str, float]) -> None:
        if self.when():
            self.inner.metrics(step, values)

    def tags(self, values: dict[str, str]) -> None:
        if self.when():
            self.inner.tags(values)

    def event(self, kind: str, **fields: object) -> None:
        if self.when():
            self.inner.event(kind, **fields)

    def hang(self, ranks: list[int], step: int | None, dump: str, stalled_s: float) -> None:
        if self.when():
            self.inner.hang(ranks, step, dump, stalled_s)

    def record_step(self, step: int, values: dict[str, float], current: dict[str, float], at: float) -> None:
        if self.when():
            self.inner.record_step(step, values, current, at)

    def committed(self, step: int) -> None:
        if self.when():
            self.inner.committed(step)

    def registered(self) -> None:
        if self.when():
            self.inner.registered()

    def discard_after(self, step: int) -> None:
        if self.when():
            self.inner.discard_after(step)

    def resume_timeline(self, resumed_from: int, attempt_starts: list[float]) -> None:
        if self.when():
            self.inner.resume_timeline(resumed_from, attempt_starts)

    def goodput(self, step: int, summary: dict[str, float], final: bool = False) -> None:
        if self.when():
            self.inner.goodput(step, summary, final)

    def refresh_loss_plot(self, wait: bool = False) -> None:
        if self.when():
            self.inner.refresh_loss_plot(wait)

    def write_recovery_tables(self) -> None:
        if self.when():
            self.inner.write_recovery_tables()
