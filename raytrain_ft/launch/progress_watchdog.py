"""The driver's progress watchdog: a run whose ranks complete no step within their bound ends the
attempt as a counted failure, with every worker's stacks recorded (`raytrain_ft.resilience.watchdog` decides).

Pieces, all started by the driver (`raytrain_ft.launch.driver`):

* `ProgressWatchdog`, a Ray actor on the driver's node (0 CPU, lives as long as the job): it holds
  `raytrain_ft.resilience.watchdog.Progress`, receives every rank's step beats (`beat`, sent by
  `RaySession.beat`, not waited for) and checks the bounds every `POLL_S` seconds in a thread of its
  own. It is an actor, not a thread in the driver process, because the workers and Ray Train's
  controller must reach it, and not a controller callback, because the controller blocks in the
  worker group's start, the moment a frozen rank stalls first.
* `launch.callbacks.WatchRanks`, a Ray Train worker-group callback (it runs in the controller):
  every time Ray Train creates worker processes (a group start, a replica's replacement) it tells
  the watchdog their ranks, pids and nodes, before their train context exists; when the group shuts
  down, it stops the watch. It lives there, not here: this module is what the watchdog actor's
  process imports, and Ray Train's callback classes would bring torch with them (~2 s of CPU per run).
* `probe` and `stop_process`, Ray tasks (0 CPU) pinned to a worker's node: `py-spy dump --nonblocking
  --pid` (what `ray stack` runs; without `--nonblocking` py-spy fails on a stopped process) and the
  process state from `/proc/<pid>/stat`; SIGKILL.
* `states_of`, a Ray task (0 CPU) per node every `LIVENESS_POLL_S`: the state of each watched process
  there, for the liveness judgement (`Progress.dead`); a node that does not answer within the poll
  counts as silent for each of its ranks.

When a rank is past its bound, or dead by the liveness polls, the watchdog: probes every watched rank;
writes the stacks to `<run folder>/hangs/step<N>-<unix s>.txt` (`run_folder.stacks_path`) and records
them through the run's `RecorderActor` (`Recorder.hang`: an MLflow artifact and a `hang` event with the
ranks, the step and the seconds stalled); logs one line naming the ranks that did not arrive and the
step; SIGKILLs those ranks. Ray Train sees their actors die (`WorkerGroupError`): under restart recovery
it restarts the group, under replica recovery it replaces those replicas, and counts the failure against
`failure.max_failures`. The failure's cause for those ranks is the watchdog's, not "killed" (`causes`,
read by `launch.callbacks.FailureRecorder`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import fsspec
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ft.core.run_folder import stacks_path
from raytrain_ft.launch.recorder_actor import RemoteRecorder
from raytrain_ft.resilience.watchdog import LIVENESS_POLL_S, Progress, Stall

log = logging.getLogger(__name__)

POLL_S = 1.0
PROBE_TIMEOUT_S = 60.0  # py-spy on every rank, in parallel
RECORD_TIMEOUT_S = 30.0


def _py_spy() -> str:
    """The `py-spy` of the running Python's environment (installed with `ray[default]`), else PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else (shutil.which("py-spy") or "py-spy")


@ray.remote(num_cpus=0)
def probe(pid: int) -> tuple[str, str]:
    """(process state letter from /proc, py-spy's dump of every thread) of `pid` on this node."""
    state = _state(pid)
    if state == "gone":
        return state, f"process {pid} is gone\n"
    try:
        out = subprocess.run(
            [_py_spy(), "dump", "--nonblocking", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S / 2,
        )
        dump = out.stdout if out.returncode == 0 else f"py-spy failed ({out.returncode}): {out.stderr.strip()}\n"
    except (OSError, subprocess.TimeoutExpired) as e:
        dump = f"py-spy failed: {e}\n"
    return state, dump


def _state(pid: int) -> str:
    """The /proc state letter of `pid` on this node, "gone" when it has exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@ray.remote(num_cpus=0)
def states_of(pids: list[int]) -> dict[int, str]:
    """{pid: `_state(pid)`} of processes on this node."""
    return {pid: _state(pid) for pid in pids}


@ray.remote(num_cpus=0)
def stop_process(pid: int) -> None:
    """SIGKILL `pid` on this node (a stopped process too); gone already is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _on(node_id: str):
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


@ray.remote(num_cpus=0, max_concurrency=8)  # type: ignore[call-overload]
class ProgressWatchdog:
    """`Progress` of the run's ranks, checked every `POLL_S` seconds (threaded actor: beats arrive
    while a check runs). `run_root`: the run folder; `recorder_actor`: the run's `RecorderActor`."""

    def __init__(
        self,
        run_root: str,
        recorder_actor: ray.actor.ActorHandle,
        step_timeout_s: float,
        start_timeout_s: float,
        max_steps: int,
        liveness_timeout_s: float,
    ):
        self.run_root, self.recorder = run_root, RemoteRecorder(recorder_actor, wait=True, timeout_s=RECORD_TIMEOUT_S)
        self.progress = Progress(step_timeout_s, start_timeout_s, max_steps, liveness_timeout_s)
        self.lock = threading.Lock()
        self.stop_causes: dict[int, str] = {}
        threading.Thread(target=self._watch, name="progress-watchdog", daemon=True).start()

    def watch(self, ranks: dict[int, tuple[int, str]]) -> None:
        with self.lock:
            self.progress.watch(ranks, time.time())

    def stop(self) -> None:
        with self.lock:
            self.progress.stop()

    def beat(self, rank: int, step: int) -> None:
        with self.lock:
            self.progress.beat(rank, step, time.time())

    def causes(self) -> dict[int, str]:
        """{rank: cause} of the ranks the watchdog stopped since the last call (then forgotten)."""
        with self.lock:
            out, self.stop_causes = self.stop_causes, {}
        return out

    def _watch(self) -> None:
        polled = time.monotonic()
        while True:
            time.sleep(POLL_S)
            with self.lock:
                stall = self.progress.stalled(time.time())
                watched = dict(self.progress.ranks)
            if stall is None and time.monotonic() - polled >= LIVENESS_POLL_S:
                polled = time.monotonic()
                states = self._states(watched)
                with self.lock:
                    stall = self.progress.dead(states, time.time())
            if stall is not None:
                try:
                    self._stop_attempt(stall, watched)
                except Exception:  # the next check tries again
                    log.exception("progress watchdog: stopping the stalled ranks failed")

    def _states(self, watched: dict) -> dict[int, str | None]:
        """rank -> process state of every watched rank (`states_of`, one task per node); None for the
        ranks of a node that did not answer within `LIVENESS_POLL_S`."""
        by_node: dict[str, dict[int, int]] = {}
        for r, w in watched.items():
            by_node.setdefault(w.node_id, {})[r] = w.pid
        refs = {
            n: states_of.options(scheduling_strategy=_on(n)).remote(list(ranks.values()))
            for n, ranks in by_node.items()
        }
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=LIVENESS_POLL_S)
        states: dict[int, str | None] = {}
        for node, ref in refs.items():
            answer: dict[int, str] = {}
            if ref in ready:
                with contextlib.suppress(ray.exceptions.RayError):
                    answer = ray.get(ref, timeout=0)
            else:
                ray.cancel(ref, force=False)
            for r, pid in by_node[node].items():
                states[r] = answer.get(pid)
        return states

    def _stop_attempt(self, stall: Stall, watched: dict) -> None:
        refs = {r: probe.options(scheduling_strategy=_on(w.node_id)).remote(w.pid) for r, w in watched.items()}
        probed: dict[int, tuple[str, str]] = {}
        for r, ref in refs.items():
            try:
                probed[r] = ray.get(ref, timeout=PROBE_TIMEOUT_S)
            except ray.exceptions.RayError as e:
                probed[r] = ("unknown", f"probe failed: {e}\n")
        with self.lock:
            ranks = self.progress.not_arrived(stall, {r: s for r, (s, _) in probed.items()})
        at = time.time()
        path = stacks_path(self.run_root, stall.step, at)
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        where = f"after step {stall.step}" if stall.step is not None else "before the first step of its start"
        bound = (
            f"its process stopped or its node silent for {stall.bound_s:g} s: failure.liveness_timeout_s"
            if stall.liveness
            else f"bound {stall.bound_s:g} s"
        )
        line = (
            f"progress watchdog: {who} did not arrive {where}: no progress for {stall.stalled_s:.0f} s "
            f"({bound}); every worker's stacks in {path}"
        )
        dump = (
            line
            + "\n"
            + "".join(
                f"\n--- rank {r} (pid {watched[r].pid}, state {probed[r][0]}, last step "
                f"{watched[r].step if watched[r].step is not None else 'none'}) ---\n{probed[r][1]}"
                for r in sorted(probed)
            )
        )
        with fsspec.open(path, "w", auto_mkdir=True) as f:
            f.write(dump)
        try:
            self.recorder.hang(ranks, stall.step, dump, stall.stalled_s)
        except Exception as e:  # the stacks are in the run folder; stop the ranks anyway
            log.warning("progress watchdog: stacks not recorded in MLflow: %s", e)
        dead = "; dead by liveness" if stall.liveness else ""
        cause = f"no progress for {stall.stalled_s:.0f} s {where} (progress watchdog{dead}; stacks: {path})"
        with self.lock:
            self.stop_causes.update({r: cause for r in ranks})
            self.progress.forget(ranks, time.time())
        log.error(line)
        print(line, file=sys.stderr, flush=True)
        for r in ranks:
            stop_process.options(scheduling_strategy=_on(watched[r].node_id)).remote(watched[r].pid)


def start_watchdog(
    run_root: str,
    recorder_actor: ray.actor.ActorHandle,
    step_timeout_s: float,
    start_timeout_s: float,
    max_steps: int,
    liveness_timeout_s: float,
) -> ray.actor.ActorHandle:
    """The run's `ProgressWatchdog`, on the driver's node (beside the `RecorderActor`)."""
    here = _on(ray.get_runtime_context().get_node_id())
    return ProgressWatchdog.options(scheduling_strategy=here).remote(  # type: ignore[attr-defined]
        run_root, recorder_actor, step_timeout_s, start_timeout_s, max_steps, liveness_timeout_s
    )


def stopped_causes(watchdog: ray.actor.ActorHandle) -> dict[int, str]:
    """{rank: cause} of the ranks the watchdog stopped since the last call (`ProgressWatchdog.causes`);
    {} when it does not answer within `RECORD_TIMEOUT_S` (the failure is recorded without them)."""
    try:
        return ray.get(watchdog.causes.remote(), timeout=RECORD_TIMEOUT_S)
    except ray.exceptions.RayError as e:
        log.warning("the progress watchdog did not answer: %s", e)
        return {}


def close(watchdog: ray.actor.ActorHandle) -> None:
    """End the watchdog (never raises: it runs on the driver's way out)."""
    with contextlib.suppress(ray.exceptions.RayError, ValueError):
        ray.kill(watchdog)
