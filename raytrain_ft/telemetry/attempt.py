"""An attempt's start record: what the loop records once an attempt has restored its checkpoint.

An attempt is one start of the training loop on a worker group: the run's first, and one per
restart, resize or resubmission. Its recorder (`replicas.Role.attempt`: rank 0, or under replica recovery replica
0 unless it is a replacement; a `NullRecorder` on every other rank) records, after the restore
(`AttemptRecord.start`, unix seconds throughout):

* the `attempt_start` event (`time`, `resumed_from`, `world_size`, `init_started_at`: when the loop
  began building), also added to the worker's copy of the run's history
  (`raytrain_ft.resilience.recovery.RunHistory`), whose events classify the goodput gap below;
* the attempt's tags and metrics (`resumed_from_step`, `world_size`, `batch_balance`), and the
  previous attempts' per-step values sorted by the attempt starts (`Recorder.resume_timeline`);
* the goodput account (`raytrain_ft.telemetry.goodput.GoodputLedger`, kept alike on every rank):
  opened at the run's start when the checkpoint held none, then the time since the checkpoint's
  snapshot classified from the history's events and the summary recorded; not for a finished run
  submitted again (its account is closed).
"""

from __future__ import annotations

import time

from raytrain_ft.core.recorder import Recorder
from raytrain_ft.resilience.recovery import RunHistory
from raytrain_ft.telemetry.goodput import GoodputLedger


class AttemptRecord:
    """The record of this attempt's start (module doc): `recorder` (the attempt's), `ledger`,
    `init_started_at` (unix seconds), the attempt's `world_size` and `batch_balance`."""

    def __init__(
        self, recorder: Recorder, ledger: GoodputLedger, init_started_at: float, world_size: int, batch_balance: float
    ):
        self.recorder, self.ledger, self.init_started_at = recorder, ledger, init_started_at
        self.world_size, self.batch_balance = world_size, batch_balance

    def start(
        self,
        history: RunHistory,
        resumed_from: int,
        step: int,
        tags: dict[str, str],
        ledger_loaded: bool,
        closed: bool,
        restored: dict | None = None,
    ) -> None:
        """After the restore (`resumed_from`: the restored checkpoint's step, 0 on a fresh start;
        `step`: the step the attempt starts at): record the attempt with `tags` and account the time
        since the checkpoint's snapshot (`history`: the run's, as read before the restore;
        `ledger_loaded`: the checkpoint held the ledger; `closed`: a finished run submitted again,
        whose account stays as it is; `restored`: `restored_from`, the tier the state came from,
        `memory`, `peer` or `storage` ("" on a fresh start), and `restore_s`, the restore's seconds)."""
        start = {
            "time": time.time(),
            "resumed_from": resumed_from,
            **(restored or {"restored_from": ""}),
            "world_size": self.world_size,
            "init_started_at": self.init_started_at,
        }
        history.record({"kind": "attempt_start", **start})
        self.recorder.tags(tags)
        self.recorder.metrics(
            step,
            {
                "resumed_from_step": resumed_from,
                "world_size": self.world_size,
                "batch_balance": self.batch_balance,
            },
        )
        self.recorder.event("attempt_start", **start)
        self.recorder.resume_timeline(resumed_from, history.attempt_starts())
        if not ledger_loaded:
            self.ledger.start(history.run_start)
        if not closed:
            self.ledger.add_gap(history.events, time.time(), fresh=not ledger_loaded)
            self.recorder.goodput(step, self.ledger.summary(time.time()))
