"""The tracking store's writes, in order, from one background thread (`Outbox`), and the bound on each
MLflow request (`bound_requests`): no caller of a `raytrain_ft.telemetry.tracking.MlflowRecorder`
waits on the store, and an unreachable one holds records instead of stalling a step."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

from mlflow.exceptions import MlflowException

log = logging.getLogger(__name__)


def bound_requests(timeout_s: float) -> None:
    """Make each MLflow HTTP request of this process give up after `timeout_s` seconds, without
    MLflow's own retries (up to minutes of backoff per request): the `Outbox` retries instead.
    Call it in a process that records a run (MLflow reads these variables at every request)."""
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(max(1, round(timeout_s)))
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"


def _refused(e: Exception) -> bool:
    """Whether the store answered and refused the write (HTTP 4xx but 429): retrying cannot help."""
    status = e.get_http_status_code() if isinstance(e, MlflowException) else 500
    return 400 <= status < 500 and status != 429


class Outbox:
    """Every write of a run's records to the tracking store, in call order, sent by one background
    thread ("mlflow-outbox"), so no caller waits on the store.

    A write the store does not take (unreachable, a timeout, HTTP 5xx) stays first and is tried
    again every `retry_s` seconds for as long as the store is away: training goes on and the writes
    are held here, then sent in order when it answers again. The outage is logged in one line when
    it begins and one when it ends, and recorded (`on_outage(held_most, seconds)`, a
    `tracking_outage` event) once it is over. A write the store refuses (HTTP 4xx) is dropped with a
    warning. At most `max_held` writes are held; beyond that new ones are dropped and counted.
    """

    def __init__(self, retry_s: float = 1.0, max_held: int = 100_000):
        self.retry_s, self.max_held = retry_s, max_held
        self.on_outage: Callable[[int, float], None] | None = None
        self._items: deque[Callable[[], object]] = deque()
        self._cv = threading.Condition()
        self._busy = False  # the head is being sent
        self.down_since: float | None = None  # monotonic time of the first failed write of the outage
        self.held_most = self.dropped = 0  # of the current (or last) outage
        self._thread: threading.Thread | None = None

    def put(self, write: Callable[[], object]) -> None:
        """Queue `write` (a call to the store); returns at once."""
        with self._cv:
            if len(self._items) >= self.max_held:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("tracking store unreachable: %d records held, dropping newer ones", self.max_held)
                return
            self._items.append(write)
            if self.down_since is not None:
                self.held_most = max(self.held_most, len(self._items))
            self._cv.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mlflow-outbox", daemon=True)
                self._thread.start()

    def held(self) -> int:
        """Writes not yet taken by the store."""
        with self._cv:
            return len(self._items) + self._busy

    def drain(self, timeout_s: float | None = None, while_down: bool = False) -> bool:
        """Wait until every write so far is taken, at most `timeout_s` seconds (None: no bound) and,
        unless `while_down` (the end of a run), not at all while the store is unreachable; True if
        none is left."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self._items or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if (self.down_since is not None and not while_down) or (left is not None and left <= 0):
                    return False
                self._cv.wait(left if left is not None else 1.0)
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
                write, self._busy = self._items[0], True
            try:
                write()
                sent = True
            except Exception as e:
                sent = _refused(e)
                if sent:
                    log.warning("the tracking store refused a record, dropped: %s", str(e).splitlines()[0][:300])
                else:
                    self._failed(e)
            with self._cv:
                self._busy = False
                if sent:
                    self._items.popleft()
                    outage = self._recovered()
                self._cv.notify_all()
            if not sent:
                time.sleep(self.retry_s)
            elif outage is not None and self.on_outage is not None:
                self.on_outage(*outage)

    def _failed(self, e: Exception) -> None:
        with self._cv:
            if self.down_since is None:
                self.down_since, self.held_most, self.dropped = time.monotonic(), len(self._items), 0
                log.warning(
                    "tracking store unreachable (%s): training goes on, records are held and sent when it answers",
                    str(e).splitlines()[0][:200],
                )

    def _recovered(self) -> tuple[int, float] | None:
        if self.down_since is None:
            return None
        seconds, self.down_since = time.monotonic() - self.down_since, None
        log.warning(
            "tracking store answers again after %.0f s: %d records were held (%d dropped)",
            seconds,
            self.held_most,
            self.dropped,
        )
        return self.held_most, seconds
