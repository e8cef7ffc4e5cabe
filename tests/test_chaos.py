"""Chaos: the test, not the training loop, SIGKILLs worker processes at seeded random moments.

Injected faults settle first (the in-flight save commits before they fire), so every other resume
test knows the exact step it resumes from. Real failures give no such courtesy. Here the loop
knows nothing: the test finds the worker processes as an operator would and kills one of them at a
seeded random moment of each of the three phases a restart goes through, in one run:

1. while a save is being written: a `slow_save` fault (slow storage: every rank's writer sleeps 1.5 s
   after creating the step folder and before writing) holds each write open long enough that "a step
   folder without `.metadata` newer than the last commit" is an observable state; the test kills while
   it holds (the pids from `<run folder>/workers/rank<r>.json`) and checks that `.metadata` never
   appeared;
2. while the next worker group starts: the new worker processes are read from Ray's actor table (what
   `ray list actors` shows) as soon as Ray created them, and one is killed before its train function
   reached a step (Ray Train raises it in its controller, or the train function dies in its setup);
3. while the group after that restores: a `slow_restore` fault (slow storage on read) holds each
   rank's read of the checkpoint 1.5 s with its file open, and the test kills a rank while
   `/proc/<pid>/fd` (what `lsof` shows) has it open; the step folder it reads is the one restored.

The run is the session `reference` run's config (30 steps, checkpoint every 5, dropout 0.1) plus
the slow storage, so it must end bitwise equal to it, with the same per-step sample ids. Its
`failure.max_failures` is exactly the three kills: each restart is counted once, alike by Ray
Train, the driver, the MLflow `restarts` metric and the recovery history.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
import ray
from mlflow.tracking import MlflowClient

from conftest import (
    BackgroundRun,
    assert_resumed,
    assert_same_state,
    events,
    final_state,
    make_config,
    metric_by_step,
    run_root,
    wait_for,
)
from raytrain_ft.core.run_folder import COMMIT_ACK_FILE, list_step_dirs, step_of, worker_records
from raytrain_ft.data.audit import read_audit
from raytrain_ft.launch.driver import restarts_left, run
from raytrain_ft.resilience.recovery import GROUP_START, KILLED, failures, recovery_rows
from raytrain_ft.telemetry.tracking import MlflowRecorder, steps_logged_since

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.exclusive]

SEED = int(os.environ.get("CHAOS_SEED", "13"))
HOLD_S = 1.5  # slow storage: every save's write and every restore's read is held this long
KILLS = 3


def steps_done_since(client: MlflowClient, run_id: str, t: float) -> list[int]:
    return [step for step, _ in steps_logged_since(client, run_id, t)]


def last_commit(root: str) -> int:
    """The step of the checkpoint Ray registered last (the controller callback's acknowledgement)."""
    try:
        with open(os.path.join(root, COMMIT_ACK_FILE)) as f:
            return step_of(f.read())
    except FileNotFoundError:
        return 0


def save_in_flight(root: str, after_step: int) -> int | None:
    """The step of a save being written (its folder exists, `.metadata` not yet) newer than `after_step`."""
    writing = [s for s, complete in list_step_dirs(root).items() if not complete and s > after_step]
    return max(writing) if writing else None


def training_workers(state: str | None = None) -> set[int]:
    """Pids of Ray Train's worker actors (all, or those in `state`), from Ray's actor table: what
    `ray list actors` shows (the state API's dashboard module is off in the test cluster: the table
    is read from the GCS directly)."""
    actors = ray._private.state.actors(actor_state_name=state).values()
    return {a["Pid"] for a in actors if a["ActorClassName"].endswith("RayTrainWorker") and a["Pid"]}


def new_workers(seen: set[int]) -> list[int] | None:
    """The pids of a whole new worker group (2 live actors not in `seen`), once Ray created them."""
    new = sorted(training_workers("ALIVE") - seen)
    return new if len(new) == 2 else None


def checkpoint_read(pid: int) -> int | None:
    """The step of the checkpoint whose data file process `pid` has open (what `lsof -p` shows), if any."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            m = re.search(r"/step-(\d+)/__\d+_\d+\.distcp$", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        if m:
            return int(m.group(1))
    return None


def restore_held(pid: int) -> int | None:
    """The step of the checkpoint `pid` is restoring, once it has held its file open for 0.25 s (the slow
    read, not the data position's brief read before the model exists)."""
    step = checkpoint_read(pid)
    if step is None:
        return None
    time.sleep(0.25)
    return step if checkpoint_read(pid) == step else None


@pytest.mark.timeout(1800)  # three restarts: on a loaded 2-core machine each one alone can take minutes
def test_kills_while_saving_starting_and_restoring_resume_bitwise(tmp_path, dataset, reference):
    ref_cfg, ref_run, ref_state = reference
    slow_storage = (
        f"faults=[{{kind: slow_save, step: 1, steps: 30, rank: -1, seconds: {HOLD_S}}},"
        f" {{kind: slow_restore, step: 1, steps: 30, rank: -1, seconds: {HOLD_S}}}]"
    )
    cfg = make_config(
        tmp_path, dataset, "train.max_steps=30", "data.audit=true", f"failure.max_failures={KILLS}", slow_storage
    )
    root = run_root(cfg)
    rng = random.Random(SEED)
    trainer = BackgroundRun(run, cfg)
    run_id_file = Path(root, "mlflow_run_id")
    run_id = wait_for("the MLflow run", lambda: run_id_file.exists() and run_id_file.read_text().strip(), trainer)
    client = MlflowClient(cfg.tracking.uri)

    # 1. while a save is being written, after the first commit
    workers = wait_for("attempt 0's workers", lambda: worker_records(root, 2, 0.0), trainer)
    started = time.time()
    wait_for("the first commit", lambda: last_commit(root), trainer)
    first = min(wait_for("a step", lambda: steps_done_since(client, run_id, started), trainer))
    writing = wait_for("a save being written", lambda: save_in_flight(root, max(first, last_commit(root))), trainer)
    time.sleep(rng.uniform(0.0, 0.5))  # a random moment inside the 1.5 s the write is held
    committed = last_commit(root)
    complete = max(s for s, ok in list_step_dirs(root).items() if ok)
    seen = training_workers()
    os.kill(workers[rng.randrange(2)]["pid"], signal.SIGKILL)
    time.sleep(1.0)
    assert not list_step_dirs(root).get(writing, False), f"step {writing} was complete at the kill"

    # 2. while the next group starts: as soon as Ray created its workers, before a step
    killed_at = time.time()
    group = wait_for("the next group's workers", lambda: new_workers(seen), trainer)
    time.sleep(rng.uniform(0.0, 2.0))
    assert steps_done_since(client, run_id, killed_at) == []
    os.kill(rng.choice(group), signal.SIGKILL)
    seen |= set(group)

    # 3. while the group after that restores the checkpoint
    group = wait_for("the group after's workers", lambda: new_workers(seen), trainer)
    victim = rng.choice(group)
    restoring = wait_for("a restore being read", lambda: restore_held(victim), trainer)
    time.sleep(rng.uniform(0.0, HOLD_S - 0.25 - 0.5))  # a random moment inside the rest of the held read
    assert checkpoint_read(victim) == restoring, "the restore was over before the kill"
    os.kill(victim, signal.SIGKILL)
    assert steps_done_since(client, run_id, killed_at) == []

    assert trainer.finished() == run_id
    # the attempts killed while starting and restoring never restored: two attempts logged their start,
    # the last from the checkpoint the killed restore was reading: the last commit before the first kill
    # (none came after it), older than the save it cut, which was deleted on restart and never loaded
    assert committed <= restoring <= complete < writing
    assert_resumed(cfg.tracking.uri, run_id, [0, restoring])
    deleted = [s for e in events(cfg.tracking.uri, run_id, "uncommitted_checkpoints_deleted") for s in e["steps"]]
    assert writing in deleted
    assert events(cfg.tracking.uri, run_id, "corrupt_checkpoint") == []

    # every restart counted once, the same in the recovery history and the MLflow run, all of the limit used
    evs = MlflowRecorder(cfg.tracking.uri, run_id).events()
    rows = recovery_rows(evs)
    assert [r["resumed_from"] for r in rows] == [restoring] * KILLS
    assert rows[0]["lost_steps"] > 0 and [r["lost_steps"] for r in rows[1:]] == [0, 0]
    for _, f in failures(evs):  # a kill from outside, whoever saw it: the controller (per rank) or the driver
        cause = f["causes"].get(GROUP_START, "") if f.get("source") == GROUP_START else " ".join(f["causes"].values())
        assert KILLED in cause, f
    assert client.get_run(run_id).data.metrics["restarts"] == KILLS
    assert (
        restarts_left(MlflowRecorder(cfg.tracking.uri, run_id), 0.0, KILLS) == 0
    )  # the driver's budget, the failure line's count

    # bitwise the uninterrupted run: model and optimizer, every step's sample ids, losses and LRs
    assert_same_state(final_state(cfg, 30), ref_state)
    assert read_audit(root).equals(read_audit(run_root(ref_cfg)))
    for key in ("train/loss", "train/lr"):
        assert metric_by_step(cfg, run_id, key) == metric_by_step(ref_cfg, ref_run, key)
