"""Goodput: the fraction of a run's wall time that produced training progress the run kept.

Wall time runs from the MLflow run's creation (the first submission) to now. The rank-0
`GoodputLedger` puts every second of it into exactly one bucket, in time order, up to
`accounted_until` (unix seconds):

* `productive`: steps on the kept timeline whose update was applied, checkpoint stalls and
  validation excluded;
* `validation`: held-out validation (`raytrain_ft.training.validation`) on the kept timeline: not training
  progress, so not productive, and not a fault either; reported as `badput_validation_s` with the
  parts below so that every bucket sums to the wall time;
* badput (`PARTS`):
  - `checkpoint_stall`: training blocked on a checkpoint (snapshot copy, or the previous write);
  - `skipped_steps`: steps whose update the spike guard skipped;
  - `lost_work`: steps (and their stalls) that a failure or a rollback threw away, i.e. work done
    after the checkpoint the run resumed from;
  - `restart_downtime`: from a failure to the start of the next attempt's workers (Ray noticing
    the failure, tearing down and starting the group, imports);
  - `restore`: building the model and loading the checkpoint, per attempt and per rollback;
  - `hang`: from a stalled rank's last step until the progress watchdog stopped it;
  - `startup`: from submission to the end of the first attempt's restore (workers, model build);
  - `replacement` (replica recovery, `raytrain_ft.resilience.replicas`): the survivors' time lost to a
    replica's failure while they keep training: a step that did not commit (a peer died in it) and
    the next quorum's wait for the lighthouse to drop the dead replica. The steps the survivors
    train with fewer participants are productive (each trains the whole global batch); the
    replacement's own start runs beside them, so it is no wall time of its own: the recovery
    history's replacement rows give its seconds (`raytrain_ft.resilience.recovery.replacement_rows`).

Per step, `StepAccount` (a step hook, `raytrain_ft.core.hooks`) adds the step to rank 0's ledger.
The ledger is part of the checkpoint (rank 0 only), so after a restore it covers the kept timeline
up to that checkpoint's snapshot. The time from there to now is classified by `classify_gap` from
the run's events (`raytrain_ft.resilience.recovery`): `failure` (controller), `attempt_start` (with
`init_started_at`), `hang` (with `stalled_s`) and `rollback` (with `restore_started_at`). This is
the usual definition of goodput ("productive time / wall time"); its parts add up
to the wall time by construction, apart from the short tail since the last step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from raytrain_ft.core.hooks import StepHook, StepResult

GAP_PARTS = ("checkpoint_stall", "skipped_steps", "lost_work", "restart_downtime", "restore", "hang", "startup")
PARTS = ("validation", *GAP_PARTS, "replacement")  # validation and replacement are only measured while training


def classify_gap(events: list[dict], start: float, end: float, fresh: bool) -> dict[str, float]:
    """Seconds of each badput part in the wall-time interval [start, end] (unix seconds).

    `events` (any order; those outside (start, end] are ignored) mark the boundaries: time is lost
    work until a `failure`, restart downtime from there to the next attempt's `init_started_at`,
    restore until that attempt's `attempt_start`, then lost work again until the next boundary
    (the caller classifies what follows its own last event). A `hang` turns its `stalled_s` before
    it into hang time; a `rollback` turns [`restore_started_at`, its time] into restore time.
    With `fresh` (no checkpoint was loaded) everything up to the first attempt's start is
    `startup`. An `attempt_start` without a failure before it (an elastic resize, or a job
    resubmitted after its driver died) has no known end of work: the time since the last boundary
    counts as lost work. A `failure` of replicas that were replaced while the others kept training
    (its `replaced` field, replica recovery) is no boundary: the survivors' steps are their own.
    """
    parts = dict.fromkeys(GAP_PARTS, 0.0)
    cursor, mode = start, "startup" if fresh else "lost_work"

    def upto(t: float, kind: str) -> None:
        nonlocal cursor
        t = min(max(t, cursor), end)
        parts[kind] += t - cursor
        cursor = t

    for e in sorted((e for e in events if start < e["time"] <= end), key=lambda e: e["time"]):
        kind = e["kind"]
        if kind == "failure" and mode == "lost_work" and not e.get("replaced"):
            upto(e["time"], mode)
            mode = "restart_downtime"
        elif kind == "attempt_start":
            upto(e.get("init_started_at", e["time"]), mode)
            upto(e["time"], "startup" if mode == "startup" else "restore")
            mode = "lost_work"
        elif kind == "hang" and mode == "lost_work":
            upto(e["time"] - e.get("stalled_s", 0.0), mode)
            upto(e["time"], "hang")
        elif kind == "rollback" and mode == "lost_work":
            upto(e.get("restore_started_at", e["time"]), mode)
            upto(e["time"], "restore")
    upto(end, mode)
    return parts


@dataclass
class GoodputLedger:
    """Rank 0's account of the run's wall time (seconds), checkpointed with the train state.

    `run_start` and `accounted_until` are unix times (seconds); everything in between is in
    `productive_s` or one of `badput_s[PARTS]`.
    """

    run_start: float = 0.0
    accounted_until: float = 0.0
    productive_s: float = 0.0
    badput_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))

    def start(self, run_start: float) -> None:
        """A fresh run: the account opens at the run's creation."""
        self.run_start = self.accounted_until = run_start

    def add_gap(self, events: list[dict], now: float, fresh: bool) -> None:
        """Classify [accounted_until, now] from `events` (after a restore or a rollback)."""
        for kind, seconds in classify_gap(events, self.accounted_until, now, fresh).items():
            self.badput_s[kind] += seconds
        self.accounted_until = max(self.accounted_until, now)

    def add_step(
        self, now: float, stall_s: float, skipped: bool, validation_s: float = 0.0, replacement_s: float = 0.0
    ) -> None:
        """Account [accounted_until, now] as one step: `stall_s` of checkpoint stall, `validation_s`
        of validation, `replacement_s` lost to a peer replica's failure, the rest productive (with
        fewer replicas too), or skipped if the guard skipped the update."""
        duration = max(0.0, now - self.accounted_until)
        stall = min(stall_s, duration)
        validation = min(validation_s, duration - stall)
        replacement = min(replacement_s, duration - stall - validation)
        self.badput_s["checkpoint_stall"] += stall
        self.badput_s["validation"] += validation
        self.badput_s["replacement"] += replacement
        rest = duration - stall - validation - replacement
        if skipped:
            self.badput_s["skipped_steps"] += rest
        else:
            self.productive_s += rest
        self.accounted_until = max(self.accounted_until, now)

    def add(self, kind: str, now: float) -> None:
        """Account [accounted_until, now] as one badput part (e.g. the final checkpoint's stall)."""
        self.badput_s[kind] += max(0.0, now - self.accounted_until)
        self.accounted_until = max(self.accounted_until, now)

    def summary(self, now: float) -> dict[str, float]:
        """`goodput` (productive / wall, in [0, 1]), `wall_s`, `productive_s`, `badput_<part>_s`
        and `unaccounted_s` (wall time not yet classified: the tail since the last step)."""
        wall = max(now - self.run_start, 1e-9)
        out = {"goodput": self.productive_s / wall, "wall_s": wall, "productive_s": self.productive_s}
        out.update({f"badput_{k}_s": v for k, v in self.badput_s.items()})
        out["unaccounted_s"] = wall - self.productive_s - sum(self.badput_s.values())
        return out

    def state_dict(self) -> dict:
        return {
            "run_start": self.run_start,
            "accounted_until": self.accounted_until,
            "productive_s": self.productive_s,
            "badput_s": dict(self.badput_s),
        }

    def load_state_dict(self, state: dict) -> None:
        self.run_start, self.accounted_until = state["run_start"], state["accounted_until"]
        self.productive_s = state["productive_s"]
        self.badput_s = {**dict.fromkeys(PARTS, 0.0), **state["badput_s"]}


class StepAccount(StepHook):
    """Rank 0's step hook: each step's wall time into `ledger` (`GoodputLedger.add_step`)."""

    def __init__(self, ledger: GoodputLedger):
        self.ledger = ledger

    def after_optimizer_step(self, result: StepResult) -> None:
        self.ledger.add_step(time.time(), result.stall_s, result.skipped, result.validation_s, result.recovery_s)
