"""Progress watchdog: the ranks' step beats (`StepBeat`, on every rank) and the decision the driver's
watchdog makes from them (`Progress`, Ray-free; `raytrain_ft.launch.progress_watchdog` acts on it).

A rank that completes no step blocks its peers in the next collective, and a frozen process (a
SIGSTOP, a device that stopped answering) freezes every thread in it, so a watchdog inside the rank
would freeze with it; during the worker group's start nothing in the rank watches at all. So the
watchdog runs outside the workers: each rank reports every completed step (`StepBeat.after_step` ->
`Session.beat`) and the driver's `Progress` decides, every second, whether a rank is past its bound:

* from a rank's start (Ray Train created its process: a group start or a replica's replacement)
  until its first step: `failure.start_timeout_s` (the process group, the model, the restore of the
  checkpoint, the first batch and the first step);
* after a step: `failure.hang_timeout_s`, or when it is 0 the larger of `STEP_FACTOR` x the median
  step time so far and `MIN_STEP_TIMEOUT_S` (a rule of thumb: a healthy step is never 10x slower;
  the floor covers a step that also saves or validates).

Those are progress bounds: a slow start is not a dead one, so the start bound is long (20 minutes by
default). Liveness is judged apart, from the moment Ray Train created the rank's process: every
`LIVENESS_POLL_S` the driver's watchdog reads each watched process's state (`/proc/<pid>/stat`, on its
node); a process stopped (`DEAD`: SIGSTOP, a tracer, a zombie) or on a node that does not answer, for
`failure.liveness_timeout_s` in a row, is dead whatever its progress bound says (`Progress.dead`):
a frozen worker in a group start is found within that bound instead of the start bound (or Ray's
RPC keepalive, minutes later).

A rank past its bound stops the attempt: the driver records every worker's stacks and stops the ranks
that did not arrive (`not_arrived`), which Ray Train counts as a failure. Under restart recovery one
stalled rank stalls every rank (they wait for it in the next collective); under replica recovery the
others train on, and only the stalled replica is past its bound. A rank that beat the run's last
step (`max_steps`) is no longer watched: its final save may take longer than a step.

This replaces the per-rank watchdog thread an earlier version ran in every worker (faulthandler
dumps and `os._exit`): everything it caught (a step that never ends: a stuck collective, a stuck
data read) the driver's watchdog catches too, from the outside, and it also catches what a thread in
the rank cannot: a frozen process and a stall before the first step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from raytrain_ft.core.hooks import StepHook

STEP_FACTOR = 10
MIN_STEP_TIMEOUT_S = 300.0
# /proc/<pid>/stat states of a process that cannot be running its step: stopped by a signal or a
# tracer, in uninterruptible sleep (a device or a filesystem that does not answer), or dead.
NOT_RUNNING = ("T", "t", "D", "Z")
# the states of a process that will not run again by itself (uninterruptible sleep may end: not dead)
DEAD = ("T", "t", "Z")
LIVENESS_POLL_S = 5.0


class StepBeat(StepHook):
    """One rank's side: `beat(step)` after every completed step (`after_step`), and the rank's median
    step time (the auto checkpoint interval plans with it)."""

    def __init__(self, beat: Callable[[int], None]):
        self.beat = beat
        self.last = time.monotonic()
        self.step_times: deque[float] = deque(maxlen=100)

    @property
    def median_step_s(self) -> float:
        """Median seconds between the last 100 steps (0 before the first)."""
        return statistics.median(self.step_times) if self.step_times else 0.0

    def restored(self) -> None:
        """The restore is done: the next step's time counts from now (a restore is not a step)."""
        self.last = time.monotonic()

    def after_step(self, step: int) -> None:
        now = time.monotonic()
        self.step_times.append(now - self.last)
        self.last = now
        self.beat(step)


@dataclass
class Watched:
    """One rank's process and progress: `since` its start, its last beat `step` at `at` (unix s)."""

    pid: int
    node_id: str
    since: float
    step: int | None = None
    at: float | None = None
    down_since: float | None = None  # first liveness poll, in the current run of them, that found it dead


@dataclass(frozen=True)
class Stall:
    """A decision to stop the attempt: `ranks` past their bound, `step` the last step every watched
    rank completed since its start (None while one has completed none), `stalled_s` seconds since
    the stalled ranks' last progress, `bound_s` the bound they passed."""

    ranks: list[int]
    step: int | None
    stalled_s: float
    bound_s: float
    liveness: bool = False  # found dead by the liveness polls (`Progress.dead`), not by a progress bound


class Progress:
    """The driver's view of every rank's progress (times are unix seconds). `step_timeout_s` 0: auto
    (`step_bound_s`)."""

    def __init__(self, step_timeout_s: float, start_timeout_s: float, max_steps: int, liveness_timeout_s: float = 45.0):
        self.step_timeout_s, self.start_timeout_s, self.max_steps = step_timeout_s, start_timeout_s, max_steps
        self.liveness_timeout_s = liveness_timeout_s
        self.ranks: dict[int, Watched] = {}
        self.step_times: deque[float] = deque(maxlen=100)

    def watch(self, ranks: dict[int, tuple[int, str]], now: float) -> None:
        """Ray Train started these ranks' processes ({rank: (pid, node id)}): a group start (every
        rank) or a replacement (some); each one's start bound counts from `now`."""
        for rank, (pid, node_id) in ranks.items():
            self.ranks[rank] = Watched(pid, node_id, now)

    def stop(self) -> None:
        """The worker group is shut down: nothing to watch until the next `watch`."""
        self.ranks.clear()

    def forget(self, ranks: list[int], now: float) -> None:
        """Stop watching `ranks` (stopped by the watchdog: Ray Train restarts or replaces them); the
        others' clocks restart at `now`: their wait for the stopped ranks is not a stall of their own."""
        for rank in ranks:
            self.ranks.pop(rank, None)
        for w in self.ranks.values():
            if w.at is None:
                w.since = now
            else:
                w.at = now

    def beat(self, rank: int, step: int, now: float) -> None:
        """`rank` completed `step`; ignored from a rank not watched (its group is gone)."""
        w = self.ranks.get(rank)
        if w is None:
            return
        if w.at is not None and step == (w.step or 0) + 1:
            self.step_times.append(now - w.at)
        w.step, w.at = step, now

    def step_bound_s(self) -> float:
        """`failure.hang_timeout_s`, or (0: auto) max(`STEP_FACTOR` x median step, `MIN_STEP_TIMEOUT_S`)."""
        if self.step_timeout_s > 0:
            return self.step_timeout_s
        median = statistics.median(self.step_times) if self.step_times else 0.0
        return max(STEP_FACTOR * median, MIN_STEP_TIMEOUT_S)

    def bound_s(self, w: Watched) -> float:
        return self.start_timeout_s if w.at is None else self.step_bound_s()

    def stalled(self, now: float) -> Stall | None:
        """The ranks past their bound (none that beat the last step), or None while all progress."""
        late = {
            r: w
            for r, w in self.ranks.items()
            if w.step != self.max_steps and now - (w.at or w.since) > self.bound_s(w)
        }
        if not late:
            return None
        oldest = min(w.at or w.since for w in late.values())
        steps = [w.step for w in self.ranks.values()]
        step = None if None in steps else min(s for s in steps if s is not None)
        return Stall(sorted(late), step, now - oldest, max(self.bound_s(w) for w in late.values()))

    def dead(self, states: dict[int, str | None], now: float) -> Stall | None:
        """Judge one liveness poll (`states`: rank -> /proc state letter, None when its node did not
        answer): the ranks found `DEAD` or unreachable in every poll for `liveness_timeout_s`, as a
        `Stall` (`bound_s`: the liveness bound), or None. A rank found alive starts over."""
        for r, w in self.ranks.items():
            gone = r in states and (states[r] is None or states[r] in DEAD)
            w.down_since = (w.down_since or now) if gone else None
        dead = {
            r: w
            for r, w in self.ranks.items()
            if w.down_since is not None and now - w.down_since >= self.liveness_timeout_s
        }
        if not dead:
            return None
        steps = [w.step for w in self.ranks.values()]
        step = None if None in steps else min(s for s in steps if s is not None)
        stalled = now - min(w.at or w.since for w in dead.values())
        return Stall(sorted(dead), step, stalled, self.liveness_timeout_s, liveness=True)

    def not_arrived(self, stall: Stall, states: dict[int, str]) -> list[int]:
        """Which of `stall.ranks` did not arrive: the ones with the oldest progress (the lowest last
        step; no step yet is lowest), and among several, those whose process is not running
        (`states`: rank -> /proc state letter, `NOT_RUNNING`) if any is; else all of the oldest.
        Under restart recovery the healthy ranks stall too, one beat later at most: they completed
        the step the stalled rank did not, or wait with it inside the same step."""
        last = {r: (self.ranks[r].step or 0) if self.ranks[r].at is not None else -1 for r in stall.ranks}
        lowest = min(last.values())
        oldest = [r for r in stall.ranks if last[r] == lowest]
        frozen = [r for r in oldest if states.get(r, "") in NOT_RUNNING]
        return frozen or oldest
