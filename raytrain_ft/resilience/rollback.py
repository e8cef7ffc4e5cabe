"""Rollback after persistent loss spikes: reload the newest checkpoint before the streak and skip a
window of data.

The spike guard (`raytrain_ft.resilience.guards.SpikeGuard`) skips single bad steps; after
`guards.spike.max_consecutive_skips` skips in a row the loop calls `Rollback`: every rank (a
collective restore) reloads the whole train state from the newest complete checkpoint of a step
before the streak's first skip and advances the data position past `guards.spike.skip_window_steps`
global batches, the ones the streak would have trained again (the PaLM recipe: restart from a
checkpoint about 100 steps before the spike and skip 200-500 batches; Chowdhery et al. 2022, sec.
5.1). The skipped sample ids are kept in the checkpointed `RollbackLog`, so the data order after a
rollback is part of the run's record. `Rollback` also moves the discarded steps' recorded values to
`train_discarded/` and accounts their seconds and the reload as a gap in the goodput ledger (the
data audit needs nothing: it replaces a step recorded again, `DataAudit.record`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.train_state import KEY_DATA, KEY_PROGRESS, KEY_ROLLBACKS, Pickled, TrainState
from raytrain_ft.core.config import Config
from raytrain_ft.core.recorder import Recorder
from raytrain_ft.core.run_folder import complete_steps, step_path
from raytrain_ft.data.manifest import Manifest
from raytrain_ft.data.order import steps_per_epoch, window_sample_ids
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.resilience.guards import NoRollbackTargetError
from raytrain_ft.resilience.recovery import RunHistory

log = logging.getLogger(__name__)


class Rollback:
    """Reloads `state` from an older checkpoint and skips a data window (every rank together).

    `state` (`raytrain_ft.checkpoint.train_state.run_state`) holds the live `Progress`,
    `DataPosition` and `RollbackLog` the loop reads: the reload restores the first two in place; the
    rollback log is kept out of the reload (it outlives it) and gains the rollback's record.
    `recorder` moves the steps after the reloaded one to `train_discarded/`; `add_gap(events, now,
    fresh)` (the goodput ledger's, reloaded with the state: `raytrain_ft.telemetry.goodput.GoodputLedger`)
    gains their seconds and the reload's; `history()` is the run's past (`Session.history`) and
    `run_root` its folder."""

    def __init__(
        self,
        cfg: Config,
        manifest: Manifest,
        plan: BatchPlan,
        checkpointer: Checkpointer,
        state: TrainState,
        run_root: str,
        history: Callable[[], RunHistory],
        recorder: Recorder,
        add_gap: Callable[[list[dict], float, bool], None],
    ):
        self.cfg, self.manifest, self.plan = cfg, manifest, plan
        self.recorder, self.add_gap, self.history = recorder, add_gap, history
        self.steps_per_epoch = steps_per_epoch(manifest, plan.global_batch_size, plan.micro_batch_size)
        self.checkpointer, self.state, self.run_root = checkpointer, state, run_root
        self.progress, self.position, self.rollbacks = (self._live(k) for k in (KEY_PROGRESS, KEY_DATA, KEY_ROLLBACKS))

    def _live(self, key: str):
        component = self.state.components[key]
        assert isinstance(component, Pickled), key
        return component.obj

    def __call__(self, step: int, consecutive: int) -> None:
        """Roll back after `consecutive` skipped steps ending at `step` (no save in flight: the
        caller settled it). Records the `rollback` event (in the run's history and by `recorder`;
        fields `at_step`, `to_step`, `skipped_steps`, `skipped_sample_ids`, `time` and
        `restore_started_at`, unix seconds) and the `rollbacks` metric at `step`.

        Raises:
            NoRollbackTargetError: no complete checkpoint of a step before the streak.
        """
        first_bad = step - consecutive + 1
        before = [s for s in complete_steps(self.run_root) if s < first_bad]
        if not before:
            raise NoRollbackTargetError(
                f"{consecutive} skipped steps in a row and no checkpoint before step {first_bad}"
            )
        history = self.history()  # every rank before the (collective) restore: before rank 0 adds to it
        restore_started_at = time.time()
        keep = self.state.components.pop(KEY_ROLLBACKS)  # the rollback record survives the reload
        try:
            self.checkpointer.restore(self.state, [step_path(self.run_root, before[-1])], lambda p, r: None)
        finally:
            self.state.add(KEY_ROLLBACKS, keep)
        c, window = self.cfg, self.cfg.guards.spike.skip_window_steps
        skipped = window_sample_ids(c.data.path, self.manifest, c.train.seed, self.position, self.plan, window)
        for _ in range(window):
            self.position.advance(self.plan.global_batch_size, self.steps_per_epoch)
        record = {
            "at_step": step,
            "to_step": self.progress.step,
            "skipped_steps": window,
            "skipped_sample_ids": skipped,
        }
        self.rollbacks.rollbacks.append(record)
        log.warning(
            "rank %d: rolled back from step %d to %d, skipping %d global batches",
            self.state.rank,
            step,
            self.progress.step,
            window,
        )
        event = {"time": time.time(), **record, "restore_started_at": restore_started_at}
        history.record({"kind": "rollback", **event})
        self.recorder.discard_after(self.progress.step)
        self.recorder.event("rollback", **event)
        self.recorder.metrics(step, {"rollbacks": len(self.rollbacks.rollbacks)})
        # the reloaded ledger ends at the checkpoint: account for the discarded steps and the reload
        self.add_gap(history.events, time.time(), False)
