"""Per-step metrics in MLflow: live at once, kept once committed, discarded apart.

MLflow cannot delete a logged value, and a restart or a rollback re-runs the steps after the
checkpoint it resumes from. So rank 0 logs each step's metrics under three prefixes:

- `train/<key>` (the kept timeline): exactly one value per step, logged once a committed
  checkpoint covers the step. A commit is registered by the runtime asynchronously, so the values
  up to the *previous* commit are published at each commit (its report could not return before Ray
  took the previous one), and all of them once the runtime confirms every commit (`settle`, the
  end of the run). Values of a crashed attempt that were not published yet are published by the
  next attempt from `train_live/<key>`;
- `train_live/<key>`: every value as it is computed, at once (the live chart; a re-run step
  appears twice here);
- `train_discarded/<key>`: values that a restart or rollback threw away (steps after the
  checkpoint resumed from), from `train_live/<key>` after a crash (what reached MLflow before it)
  or from memory after a rollback.

The prefixes are chosen for what a person opens first: MLflow 3.17's run page (*Model metrics*)
shows one section per prefix before the `/`, sorted by name, above the section of un-prefixed
metrics; `train` sorts before `train_discarded` and `train_live`, so the kept timeline is the first
section (checked in a real browser: `scripts/check_mlflow_ui.py`).

All logging goes through the recorder's `outbox.Outbox` (one background thread, in order, held
while the store is unreachable, `MAX_BATCH` values per request), so a slow or absent tracking
server never blocks a training step.

A restart that falls back from a corrupt checkpoint to an older one re-runs steps that are already
on the kept timeline. Training is deterministic in (seed, step), so the re-run values equal the kept
ones: the kept value stays, the re-run one is not published again (it is under `train_live/`), and
those steps are not discarded (the run's final weights were trained on them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

if TYPE_CHECKING:
    from raytrain_ft.telemetry.outbox import Outbox

KEPT, LIVE, DISCARDED = "train/", "train_live/", "train_discarded/"
MAX_BATCH = 1000  # MLflow's limit on metrics per log_batch request


class StepTimeline:
    """Rank 0's per-step metrics (see the module docstring). Not thread-safe: call from the loop."""

    def __init__(self, client: MlflowClient, run_id: str, outbox: Outbox):
        self.client, self.run_id, self.outbox = client, run_id, outbox
        self.pending: list[tuple[int, int, dict[str, float]]] = []  # (step, time ms, values), not published
        self.covered = 0  # the newest committed step (registration maybe not confirmed yet)
        self.kept_before: dict[str, set[int]] = {}  # steps each key had on the kept timeline at this attempt's start

    def record(self, step: int, values: dict[str, float], current: dict[str, float], at: float) -> None:
        """One step's metrics (`train_live/` now, the kept timeline `train/` later), computed at unix time `at`
        (seconds); `current` values are logged at step 0, where MLflow's "latest" is the newest
        value (the controller reads `last_step`)."""
        ts = int(at * 1000)
        self.pending.append((step, ts, values))
        batch = [Metric(LIVE + k, float(v), ts, step) for k, v in values.items()]
        self._send(batch + [Metric(k, float(v), ts, 0) for k, v in current.items()])

    def committed(self, step: int) -> None:
        """A checkpoint at `step` was committed: publish the steps of the previous commit."""
        previous, self.covered = self.covered, step
        self._publish(previous)

    def registered(self) -> None:
        """The runtime confirmed every commit: publish every committed step."""
        self._publish(self.covered)

    def discard_after(self, step: int) -> None:
        """A rollback to the checkpoint at `step`: the later recorded steps go to `train_discarded/`."""
        gone = [p for p in self.pending if p[0] > step]
        self.pending = [p for p in self.pending if p[0] <= step]
        self._send([Metric(DISCARDED + k, float(v), ts, s) for s, ts, vals in gone for k, v in vals.items()])

    def recover(self, resumed_from: int, attempt_starts: list[float]) -> None:
        """At the start of an attempt, in the background: sort the previous attempt's `train_live/`
        values (logged between the last two `attempt_starts`, unix seconds) into the kept timeline
        (steps up to `resumed_from` not published yet) and `train_discarded/` (later steps)."""
        if len(attempt_starts) < 2:
            return
        since, until = int(attempt_starts[-2] * 1000), int(attempt_starts[-1] * 1000)
        self.outbox.put(lambda: self._recover(resumed_from, since, until))

    def _recover(self, resumed_from: int, since: int, until: int) -> None:
        live_keys = [k for k in self.client.get_run(self.run_id).data.metrics if k.startswith(LIVE)]
        batch = []
        for live_key in live_keys:
            key = KEPT + live_key[len(LIVE) :]
            kept = self.kept_before[key] = {m.step for m in self.client.get_metric_history(self.run_id, key)}
            newest: dict[int, Metric] = {}  # a step re-run after a rollback: its newest value is kept
            for m in sorted(self.client.get_metric_history(self.run_id, live_key), key=lambda m: m.timestamp):
                if not since <= m.timestamp < until:
                    continue
                if m.step > resumed_from and m.step not in kept:
                    batch.append(Metric(DISCARDED + live_key[len(LIVE) :], m.value, m.timestamp, m.step))
                elif m.step not in kept:
                    newest[m.step] = Metric(key, m.value, m.timestamp, m.step)
            batch += newest.values()
        self._send(batch)

    def _publish(self, upto: int) -> None:
        ready = [p for p in self.pending if p[0] <= upto]
        self.pending = [p for p in self.pending if p[0] > upto]
        self._send([Metric(KEPT + k, float(v), ts, s) for s, ts, vals in ready for k, v in vals.items()])

    def _send(self, batch: list[Metric]) -> None:
        """Queue `batch` in requests of `MAX_BATCH` values, each retried whole by the outbox; steps
        already on the kept timeline (known once `_recover` ran) are left out when it is sent."""
        for i in range(0, len(batch), MAX_BATCH):
            chunk = batch[i : i + MAX_BATCH]
            self.outbox.put(lambda chunk=chunk: self._log(chunk))  # type: ignore[misc]

    def _log(self, chunk: list[Metric]) -> None:
        fresh = [m for m in chunk if m.step not in self.kept_before.get(m.key, ())]
        if fresh:
            self.client.log_batch(self.run_id, metrics=fresh)
