"""Chaos: the test, not the training loop, SIGKILLs worker processes at seeded random moments.

Injected faults settle first (the in-flight save commits before they fire), so every other resume
test knows the exact step it resumes from. Real failures give no such courtesy. Here the loop
knows nothing: the test reads the worker processes from the files each worker writes
(`<run folder>/workers/rank<r>.json`, pid per attempt), waits for a seeded random moment and kills
one of them, three times in one run. One kill waits for a save being written: a `slow_save` fault
(slow storage: every rank's writer sleeps 1.5 s after creating the step folder and before writing)
holds each write open long enough that "a step folder without `.metadata` newer than the last
commit" is an observable state, and the test kills while it holds (and checks after the kill
that `.metadata` never appeared). Ray restarts the group each time.

The run is the session `reference` run's config (30 steps, checkpoint every 5, dropout 0.1) plus
the slow storage, so it must end bitwise equal to it, with the same per-step sample ids.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import (
    COMMITTED,
    assert_resumed,
    assert_same_state,
    events,
    final_state,
    make_config,
    metric_by_step,
    run_root,
)
from raytrain_ft.data.audit import read_audit
from raytrain_ft.launch.driver import run
from raytrain_ft.run_folder import COMMIT_ACK_FILE, list_step_dirs, step_of, worker_records
from raytrain_ft.tracking import steps_logged_since

pytestmark = pytest.mark.usefixtures("ray_local")

SEED = int(os.environ.get("CHAOS_SEED", "13"))
KILLS = 3
WAIT_S = 600  # any single wait longer than this is a hung run, not a slow machine


def wait_for(what: str, condition, trainer: threading.Thread):
    """Poll `condition()` until it returns a truthy value; fail if the run ended first."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        assert trainer.is_alive(), f"the run ended while the test waited for {what}"
        time.sleep(0.05)
    raise AssertionError(f"waited {WAIT_S} s for {what}")


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


@pytest.mark.timeout(1800)  # three restarts: on a loaded 2-core machine each one alone can take minutes
def test_three_kills_at_random_moments_resume_bitwise(tmp_path, dataset, reference):
    ref_cfg, ref_run, ref_state = reference
    slow_storage = "faults=[{kind: slow_save, step: 1, steps: 30, rank: -1, seconds: 1.5}]"
    cfg = make_config(
        tmp_path, dataset, "train.max_steps=30", "data.audit=true", "failure.max_failures=4", slow_storage
    )
    root = run_root(cfg)
    rng = random.Random(SEED)
    during_save = rng.randrange(KILLS)  # which kill waits for a save being written
    result: dict = {}
    trainer = threading.Thread(target=lambda: result.update(run_id=run(cfg)), daemon=True)
    trainer.start()
    run_id_file = Path(root, "mlflow_run_id")
    run_id = wait_for("the MLflow run", lambda: run_id_file.exists() and run_id_file.read_text().strip(), trainer)
    client = MlflowClient(cfg.tracking.uri)

    kills, since = [], 0.0
    for k in range(KILLS):
        workers = wait_for(f"attempt {k}'s workers", lambda since=since: worker_records(root, 2, since), trainer)
        started = time.time()
        # this attempt restored and trained a step (so it also deleted any partial folder of the last kill)
        wait_for(
            f"attempt {k}'s first step", lambda started=started: steps_done_since(client, run_id, started), trainer
        )
        if k == 0:  # after the first commit: no attempt may resume from 0
            wait_for("the first commit", lambda: last_commit(root), trainer)
        if k == during_save:
            first = min(steps_done_since(client, run_id, started))
            writing = wait_for("a save being written", lambda f=first: save_in_flight(root, f - 1), trainer)
            time.sleep(rng.uniform(0.0, 0.5))  # a random moment inside the 1.5 s the write is held
        else:
            steps = rng.randint(3, 9)  # a random number of steps into the attempt, then a random moment in a step
            wait_for(
                f"{steps} steps", lambda s=steps, t=started: len(set(steps_done_since(client, run_id, t))) >= s, trainer
            )
            time.sleep(rng.uniform(0.0, 1.0))
            writing = None
        committed, complete = last_commit(root), max((s for s, ok in list_step_dirs(root).items() if ok), default=0)
        rank = rng.randrange(2)
        os.kill(workers[rank]["pid"], signal.SIGKILL)
        since = time.time()
        if writing is not None:  # the write was cut: its .metadata never appears
            time.sleep(1.0)
            assert not list_step_dirs(root).get(writing, False), (
                f"step {writing} was complete when rank {rank} was killed"
            )
        kills.append({"rank": rank, "committed": committed, "complete": complete, "writing": writing})

    trainer.join(timeout=WAIT_S)
    assert not trainer.is_alive() and result.get("run_id") == run_id, "the run did not finish"
    # each attempt resumed from a committed checkpoint (never 0) no older than the last commit
    # registered before its kill and no newer than the newest complete folder at the kill
    attempts = assert_resumed(cfg.tracking.uri, run_id, [0] + [COMMITTED] * KILLS)
    for kill, attempt in zip(kills, attempts[1:], strict=True):
        assert kill["committed"] <= attempt["resumed_from"] <= kill["complete"], (kills, attempts)
    # the save cut by a kill was deleted on restart, never loaded
    cut = kills[during_save]
    assert attempts[during_save + 1]["resumed_from"] < cut["writing"]
    deleted = [s for e in events(cfg.tracking.uri, run_id, "uncommitted_checkpoints_deleted") for s in e["steps"]]
    assert cut["writing"] in deleted
    assert events(cfg.tracking.uri, run_id, "corrupt_checkpoint") == []
    assert client.get_run(run_id).data.metrics["restarts"] == KILLS

    # bitwise the uninterrupted run: model and optimizer, every step's sample ids, losses and LRs
    assert_same_state(final_state(cfg, 30), ref_state)
    assert read_audit(root).equals(read_audit(run_root(ref_cfg)))
    for key in ("train/loss", "train/lr"):
        assert metric_by_step(cfg, run_id, key) == metric_by_step(ref_cfg, ref_run, key)
