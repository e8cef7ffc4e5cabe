"""Step watchdog: a rank that completes no step for `timeout_s` dumps every thread's stack and exits.

A hung collective or a stuck data read otherwise blocks forever (the process-group timeout covers
collectives only, and only when the backend honours it). The watchdog is a daemon thread: if no
`beat()` arrives for `timeout_s` seconds it writes `faulthandler`'s dump of all Python threads to
stderr (the Ray worker log) and to `<run folder>/hangs/rank<R>-<unix time>.txt`, calls `on_hang`
with the dump and the seconds since the last step (logged to MLflow), waits `HANG_EXIT_GRACE_S`
(so peers that fired at the same time report too), then `os._exit(HANG_EXIT_CODE)`, so Ray
restarts the worker group from the last checkpoint.

The watchdog is a step hook (`raytrain_ft.hooks`): `after_step` beats.

Timeout: `failure.hang_timeout_s`, or when it is 0 the larger of 10 x the median step time so far
and 300 s (a rule of thumb: a step is never 10x slower when healthy).
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable

import fsspec

from raytrain_ft.hooks import StepHook
from raytrain_ft.run_folder import hang_dump_path

HANG_EXIT_CODE = 75
# A hung rank's peers block in their next collective one beat later at most, so their watchdogs fire
# within about a second of each other. The first rank to exit makes Ray tear the whole group down,
# which killed the rank that actually hung while it was still reporting its stacks (a fresh-clone CI
# run of test_a_hung_rank_...: only rank 0, blocked in an all-reduce, was recorded). Every rank waits
# this long after its own report before exiting, so each rank that fired gets its report in.
HANG_EXIT_GRACE_S = 10.0
MIN_AUTO_TIMEOUT_S = 300.0


class StepWatchdog(StepHook):
    def __init__(self, timeout_s: float, run_root: str, rank: int, on_hang: Callable[[str, float], None] | None = None):
        self.fixed_timeout_s, self.run_root, self.rank, self.on_hang = timeout_s, run_root.rstrip("/"), rank, on_hang
        self.last_beat = time.monotonic()
        self.step_times: deque[float] = deque(maxlen=100)
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="step-watchdog", daemon=True).start()

    @property
    def timeout_s(self) -> float:
        if self.fixed_timeout_s > 0:
            return self.fixed_timeout_s
        return max(10 * self.median_step_s, MIN_AUTO_TIMEOUT_S)

    @property
    def median_step_s(self) -> float:
        """Median seconds between the last 100 beats (0 before the first)."""
        return statistics.median(self.step_times) if self.step_times else 0.0

    def beat(self, step_done: bool = True) -> None:
        """Call after every completed step; `step_done=False` restarts the clock without a step-time
        sample (after a restore, which is not a step)."""
        now = time.monotonic()
        if step_done:
            self.step_times.append(now - self.last_beat)
        self.last_beat = now

    def after_step(self, step: int) -> None:
        self.beat()

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while not self.stopped.wait(1.0):
            if time.monotonic() - self.last_beat > self.timeout_s:
                self._dump_and_exit()

    def _dump_and_exit(self) -> None:
        stalled_s = time.monotonic() - self.last_beat
        with tempfile.TemporaryFile("w+") as f:
            f.write(f"rank {self.rank}: no step completed for {self.timeout_s:.0f} s; stacks of all threads:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.seek(0)
            dump = f.read()
        sys.stderr.write(dump)
        sys.stderr.flush()
        try:
            with fsspec.open(hang_dump_path(self.run_root, self.rank, time.time()), "w", auto_mkdir=True) as out:
                out.write(dump)
            if self.on_hang:
                self.on_hang(dump, stalled_s)
            time.sleep(HANG_EXIT_GRACE_S)
        finally:
            os._exit(HANG_EXIT_CODE)
