"""The run's recovery history, derived from the events every component logs to MLflow.

Events (artifacts `events/*.json`, see `tracking.MlflowRecorder.event`): `failure` (one per restart, written
by the Ray Train controller callback `launch.callbacks.FailureRecorder`, or by the driver for a worker
lost while the group started: time, short cause per rank (root cause first, see `cause_text`) and
Ray's full text per rank, last completed step, step time and world size at
that moment), `attempt_start` (rank 0 after restore: step resumed from, world size) and
`first_step` (rank 0 after the first step of an attempt). `recovery_rows` joins them into one row
per failure: wall time, cause, last completed step, step resumed from, lost steps, lost compute
(lost steps x the step time at the failure, seconds), where the state came from (`restored_from`:
`memory`, each rank's own node's memory tier; `peer`, some rank's copy on another node; `storage`,
the durable checkpoint; `raytrain_ft.checkpoint.memory_tier`) and the restore's seconds (`restore_s`), the
recovery's phases as seconds after the
failure was detected (`group_ready_s`: the new worker group's process group is up and the loop
starts; `restored_s`: the checkpoint is loaded; `first_batch_s`: the first batch is ready;
`downtime_s`: the first step is done), world size before and after. Guard events (skipped steps, rollbacks, rank alerts,
hangs, corrupt checkpoints) form a second table.

Under `failure.recovery: replica` a failure of some replicas while others are healthy is no restart:
Ray Train replaces only those (the `failure` event lists them under `replaced`) and the survivors
keep training. `replacement_rows` makes one row per replaced replica from that event and the
replica events (`raytrain_ft.resilience.replicas`): `replica_start` (the replacement restored, before it
joined a quorum), `replica_joined` (its first committed step), and the steps the survivors
completed (the `last_step` metric's history). `preemption_rows`: one row per node drained for
preemption (`raytrain_ft.resilience.preemption`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from datetime import datetime, timezone

GUARD_EVENT_KINDS = (
    "skipped_step",
    "rollback",
    "rank_spread",
    "replica_mismatch",
    "hang",
    "corrupt_checkpoint",
    "step_not_committed",
    "straggler",
    "straggler_recovered",
)
RECOVERY_TABLE = "recovery_history.json"
REPLACEMENT_TABLE = "replica_replacements.json"
GUARD_TABLE = "guard_events.json"


GROUP_START = "group_start"  # a failure the driver records: a worker lost while Ray Train started the group
KILLED = "killed (SIGKILL, OOM killer or os._exit: the process died without an exception)"
CONSEQUENCE = "lost its connection to a failed peer (a consequence)"


def root_first(causes: dict[str, str]) -> list[tuple[str, str]]:
    """(rank, cause) pairs of one failure, root causes first (peers' `CONSEQUENCE`s last), then by rank
    (`GROUP_START`, a worker lost while the group started, whose rank is not known: first)."""
    return sorted(causes.items(), key=lambda rc: (rc[1] == CONSEQUENCE, int(rc[0]) if rc[0].isdigit() else -1))


def who(rank: str) -> str:
    """`rank R`, or the group start for a worker lost while the group started (`GROUP_START`)."""
    return f"rank {rank}" if rank.isdigit() else "the worker group start"


def cause_text(causes: dict[str, str]) -> str:
    """`rank R: cause; ...`, root cause first; peers that only lost their connection are counted, not listed."""
    pairs = root_first(causes)
    roots = [f"{who(r)}: {c}" for r, c in pairs if c != CONSEQUENCE]
    peers = [r for r, c in pairs if c == CONSEQUENCE]
    if peers:
        roots.append(f"rank{'s' if len(peers) > 1 else ''} {', '.join(peers)}: {CONSEQUENCE}")
    return "; ".join(roots)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="seconds")


def failures(events: list[dict]) -> list[tuple[int, dict]]:
    """(index, failure) pairs, oldest first: one `failure` event per restart (or per failure that ended the
    run), as `launch.callbacks.FailureRecorder` and the driver (`source: GROUP_START`) record them."""
    return [(i, e) for i, e in enumerate(events) if e["kind"] == "failure"]


CONTROL_KINDS = ("failure", "attempt_start", "hang", "rollback")  # the events the loop decides with


@dataclass
class RunHistory:
    """The run's past that the loop decides with: when the run began and its `CONTROL_KINDS` events.

    Where it comes from (the loop never reads the tracking store): the process that records the
    events keeps it. On Ray that is the job's `RecorderActor` (`raytrain_ft.launch.recorder_actor`),
    which loads it from the store once when it starts (once per submission: the earlier
    submissions' record) and then adds every event it records (the controller's failures, rank 0's
    attempt starts and rollbacks, hung ranks' reports, the driver's group-start failures); without Ray,
    the `LocalSession`'s recorder. Workers get a copy through `Session.history()` at an attempt's
    start and at a rollback, and add their own new event to it (`record`). It feeds:

    * the goodput ledger's gap since the checkpoint's snapshot (`GoodputLedger.add_gap`);
    * the MTBF of the auto checkpoint interval (`failure_times`, `run_start`);
    * the sorting of the previous attempt's per-step values (`attempt_starts`).

    `run_start`: the MLflow run's creation (the first submission), unix seconds. `events`: oldest
    first, without Ray's full error texts (`details`).
    """

    run_start: float
    events: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, run_start: float, events: list[dict]) -> RunHistory:
        """The history of a run created at `run_start` with `events` (any kinds, any order)."""
        history = cls(run_start)
        for e in events:
            history.record(e)
        return history

    def record(self, event: dict) -> None:
        """Add `event` (`{"time", "kind", ...}`) in time order, if it is one of `CONTROL_KINDS`."""
        if event["kind"] in CONTROL_KINDS:
            kept = {k: v for k, v in event.items() if k != "details"}
            bisect.insort(self.events, kept, key=lambda e: e["time"])

    def failure_times(self) -> list[float]:
        """Unix seconds of the run's failures (`failures`: one per restart)."""
        return [f["time"] for _, f in failures(self.events)]

    def attempt_starts(self) -> list[float]:
        """Unix seconds of every attempt's start (its `attempt_start` event), oldest first."""
        return [e["time"] for e in self.events if e["kind"] == "attempt_start"]


def recovery_rows(events: list[dict]) -> list[dict]:
    """One dict per failure (oldest first); fields not known yet (no resume so far) are None. A failure
    that struck before its attempt had restored (no `attempt_start` since the failure before it: the
    worker group was starting or loading the checkpoint) lost no steps: the steps since the checkpoint
    count once, at the failure that ended the attempt that trained them."""
    rows = []
    previous = -1
    for i, e in failures(events):
        if e.get("replaced"):  # a replacement (`replacement_rows`): the survivors kept training
            continue
        later = events[i + 1 :]
        trained = any(x["kind"] == "attempt_start" for x in events[previous + 1 : i])
        previous = i
        start = next((x for x in later if x["kind"] == "attempt_start"), None)
        first = next((x for x in later if x["kind"] == "first_step" and start and x["time"] >= start["time"]), None)
        resumed = start["resumed_from"] if start else None
        lost = (e["last_step"] - resumed if trained else 0) if resumed is not None else None

        def since(t: float | None, failed_at: float = e["time"]) -> float | None:
            return round(t - failed_at, 3) if t is not None else None

        rows.append(
            {
                "failed_at": _iso(e["time"]),
                "cause": cause_text(e["causes"]),
                "last_step": e["last_step"],
                "resumed_from": resumed,
                "restored_from": start.get("restored_from", "storage") if start else None,
                "restore_s": start.get("restore_s") if start else None,
                "lost_steps": lost,
                "lost_compute_s": round(lost * e["step_time_s"], 3) if lost is not None else None,
                "group_ready_s": since(start.get("init_started_at") if start else None),
                "restored_s": since(start["time"] if start else None),
                "first_batch_s": since(first.get("first_batch_at") if first else None),
                "downtime_s": since(first["time"] if first else None),
                "world_size_before": e["world_size"],
                "world_size_after": start["world_size"] if start else None,
            }
        )
    return rows


def replacement_rows(events: list[dict], steps_done: list[tuple[int, float]]) -> list[dict]:
    """One dict per replica replaced while the others kept training (oldest first): when it failed,
    which replica, the cause, the last step completed before the failure; the seconds after the
    failure was detected until the survivors completed a later step (`survivors_committed_s`, from
    `steps_done`: (step, unix seconds) of every completed step), until the replacement had restored
    (`replacement_restored_s`; `restored_from`: the committed checkpoint it loaded, before it healed
    from a live peer) and until it first took part in a committed step (`replacement_joined_s`, at
    `joined_step` with `participants` replicas). Fields not known yet are None."""
    rows = []
    done = sorted(steps_done, key=lambda st: st[1])
    for i, e in failures(events):
        if not e.get("replaced"):
            continue
        later = events[i + 1 :]
        committed = next((t for s, t in done if t > e["time"] and s > e["last_step"]), None)

        def since(t: float | None, failed_at: float = e["time"]) -> float | None:
            return round(t - failed_at, 3) if t is not None else None

        for replica in e["replaced"]:
            mine = [x for x in later if x.get("replica") == replica]
            start = next((x for x in mine if x["kind"] == "replica_start"), None)
            joined = next((x for x in mine if x["kind"] == "replica_joined"), None)
            rows.append(
                {
                    "failed_at": _iso(e["time"]),
                    "replica": replica,
                    "cause": cause_text({str(replica): e["causes"].get(str(replica), "")}),
                    "last_step": e["last_step"],
                    "survivors_committed_s": since(committed),
                    "replacement_restored_s": since(start["time"] if start else None),
                    "restored_from": start["resumed_from"] if start else None,
                    "replacement_joined_s": since(joined["time"] if joined else None),
                    "joined_step": joined["step"] if joined else None,
                    "participants": joined["participants"] if joined else None,
                }
            )
    return rows


def preemption_rows(events: list[dict]) -> list[dict]:
    """One row per `preemption` event (`raytrain_ft.resilience.preemption`: a node drained for preemption):
    node, rank, notice time, seconds from the notice to the deadline, the step committed after the
    notice, whether a checkpoint of it was written, seconds from the notice to that commit."""
    return [
        {
            "notice_time": _iso(e["notice_time"]),
            "node": e["node"],
            "rank": e["rank"],
            "window_s": None if e["deadline"] is None else round(e["deadline"] - e["notice_time"], 1),
            "step_saved": e["step_saved"],
            "checkpoint": e["checkpoint"],
            "notice_to_committed_s": round(e["notice_to_committed_s"], 2),
        }
        for e in events
        if e["kind"] == "preemption"
    ]


def guard_rows(events: list[dict]) -> list[dict]:
    """Guard events, one dict each: time, kind, step and the event's other fields as text."""
    return [
        {
            "time": _iso(e["time"]),
            "kind": e["kind"],
            "step": e.get("step", e.get("at_step")),
            "detail": ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "kind", "step"))[:500],
        }
        for e in events
        if e["kind"] in GUARD_EVENT_KINDS
    ]


def totals(rows: list[dict]) -> dict[str, float]:
    """`restarts`, `lost_steps_total`, `downtime_s_total` over the recovery rows."""
    return {
        "restarts": float(len(rows)),
        "lost_steps_total": float(sum(r["lost_steps"] or 0 for r in rows)),
        "downtime_s_total": float(sum(r["downtime_s"] or 0 for r in rows)),
    }


def split_table(rows: list[dict]) -> dict[str, list]:
    """Row dicts -> `{"columns": [...], "data": [[...], ...]}` (pandas "split" layout, as `mlflow.log_table`)."""
    keys = list(rows[0]) if rows else []
    return {"columns": keys, "data": [[r[k] for k in keys] for r in rows]}
