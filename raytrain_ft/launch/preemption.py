"""Drain notices of this worker's node, read from Ray's GCS: the one place the run reads them.

Ray 2.60 has no public API for a node's drain state: `ray_internals.draining_nodes` reads it, as Ray
Train's own `PreemptionWatcher` does (which Ray Train registers for plain worker groups, not for
torchft replica groups), and this module is its one caller. A drain of a node that
runs workers is a preemption: Ray's raylet refuses an idle-termination drain of a busy node.

`DrainWatcher` polls it in a daemon thread of every worker, every `POLL_INTERVAL_S`, for the
worker's own node: `notice()` never waits (the loop asks every step; the step's members agree on it
in their own all-reduce, `raytrain_ft.resilience.preemption`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from raytrain_ft.launch.ray_internals import draining_nodes
from raytrain_ft.resilience.preemption import Notice

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.0  # a notice is seen at most this long after the drain (GKE gives 30 s, AWS 120 s)


class DrainWatcher:
    """This worker's node's drain notice (`notice()`), polled in the background.

    Args:
        node_id: this worker's Ray node id (hex).
        records: this worker records a `preemption` event for its rank.
        poll: the drain source (`draining_nodes`).
    """

    def __init__(
        self,
        node_id: str,
        records: bool,
        poll: Callable[[], dict[str, int]] = draining_nodes,
        interval_s: float = POLL_INTERVAL_S,
    ):
        self.node_id, self.records, self.poll, self.interval_s = node_id, records, poll, interval_s
        self.current: Notice | None = None
        threading.Thread(target=self._watch, name="drain-watcher", daemon=True).start()

    def notice(self) -> Notice | None:
        return self.current

    def _watch(self) -> None:
        while True:
            try:
                drained = self.poll()
            except Exception:  # a GCS hiccup: the next poll tries again
                log.warning("reading the draining nodes failed", exc_info=True)
                drained = None
            if drained is not None:
                deadline_ms = drained.get(self.node_id)
                if deadline_ms is None:
                    self.current = None  # not (or no longer) drained
                elif self.current is None:
                    deadline = deadline_ms / 1000 if deadline_ms else None
                    self.current = Notice(self.node_id, time.time(), deadline, self.records)
            time.sleep(self.interval_s)
