"""Replica recovery (`failure.recovery: replica`, torchft): a replica killed between steps is replaced
while the other keeps training, and the run keeps the project's guarantees per committed step.

Two replicas (2 CPU workers, gloo, the tiny preset). Every step sleeps 1 s (a `slow` fault, every
pass) so the survivor is still training when Ray Train's replacement arrives and heals from it. The
test, not the loop, SIGKILLs replica 1's process (its pid from `<run folder>/workers/rank1.json`)
after a seeded random number of steps.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import WAIT_S, final_state, make_config, metric_by_step, run_root, uninterrupted_lrs, wait_for
from raytrain_ft.data.audit import read_audit
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import window_sample_ids
from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.launch.driver import run
from raytrain_ft.replicas import state_digest
from raytrain_ft.run_folder import read_latest, step_path, worker_records
from raytrain_ft.tracking import steps_logged_since

pytestmark = pytest.mark.usefixtures("ray_local")

SEED = int(os.environ.get("REPLICA_SEED", "5"))
STEPS = 24


def final_digest(root: str, replica: int) -> dict:
    return json.loads(Path(root, "workers", f"replica{replica}.final.json").read_text())


@pytest.mark.timeout(900)
def test_a_replica_killed_between_steps_is_replaced_while_the_other_keeps_training(tmp_path, dataset):
    cfg = make_config(
        tmp_path,
        dataset,
        "failure.recovery=replica",
        f"train.max_steps={STEPS}",
        "checkpoint.interval_steps=4",
        "data.audit=true",
        "failure.max_failures=2",
        f"faults=[{{kind: slow, step: 1, steps: {STEPS}, rank: -1, seconds: 1.0}}]",
    )
    root = run_root(cfg)
    rng = random.Random(SEED)
    result: dict = {}
    trainer = threading.Thread(target=lambda: result.update(run_id=run(cfg)), daemon=True)
    trainer.start()
    run_id_file = Path(root, "mlflow_run_id")
    run_id = wait_for("the MLflow run", lambda: run_id_file.exists() and run_id_file.read_text().strip(), trainer)
    client = MlflowClient(cfg.tracking.uri)
    workers = wait_for("both replicas", lambda: worker_records(root, 2, 0.0), trainer)
    kill_after = rng.randint(3, 6)
    wait_for(
        f"{kill_after} steps",
        lambda: len({s for s, _ in steps_logged_since(client, run_id, 0.0)}) >= kill_after,
        trainer,
    )
    time.sleep(rng.uniform(0.0, 1.0))
    os.kill(workers[1]["pid"], signal.SIGKILL)
    killed_at = time.time()

    trainer.join(timeout=WAIT_S)
    assert not trainer.is_alive() and result.get("run_id") == run_id, "the run did not finish"
    after = worker_records(root, 2, 0.0)
    assert after is not None
    # the survivor kept its process; Ray Train replaced only the killed replica
    assert after[0]["pid"] == workers[0]["pid"] and after[0]["started_at"] == workers[0]["started_at"]
    assert after[1]["pid"] != workers[1]["pid"] and after[1]["started_at"] > killed_at

    # every committed step trained the uninterrupted run's global batch, whoever took part
    manifest, g = load_manifest(cfg.data.path), cfg.train.global_batch_size
    plan = BatchPlan(g, cfg.train.micro_batch_size, 1)
    expected = window_sample_ids(cfg.data.path, manifest, cfg.train.seed, DataPosition(), plan, STEPS)
    audit = read_audit(root).to_pydict()
    trained: dict[int, list[int]] = {}  # rows come rank by rank, each rank's span in lane order
    participants: dict[int, set[int]] = {}
    for step, rank, sample in zip(audit["step"], audit["rank"], audit["sample_id"], strict=True):
        trained.setdefault(step, []).append(sample)
        participants.setdefault(step, set()).add(rank)
    assert sorted(trained) == list(range(1, STEPS + 1))
    for step, ids in trained.items():
        assert ids == expected[(step - 1) * g : step * g], step
    # the survivor trained some steps alone after the kill, and the healed replacement joined it again
    alone = [s for s, ranks in participants.items() if len(ranks) == 1 and s > kill_after]
    assert alone and len(participants[STEPS]) == 2, {s: len(r) for s, r in participants.items()}
    # the LR of every step replica 0 (the one that records) trained is the schedule's; it misses only the
    # first steps when replica 1 started first and trained them before replica 0 joined and healed
    logged, schedule = metric_by_step(cfg, run_id, "train/lr"), uninterrupted_lrs(cfg.train)
    assert logged == {s: schedule[s] for s in range(min(logged), STEPS + 1)} and min(logged) <= kill_after
    # both replicas ended bitwise equal to each other and to the final checkpoint
    zero, one = final_digest(root, 0), final_digest(root, 1)
    assert zero["step"] == one["step"] == STEPS
    assert read_latest(root) == step_path(root, STEPS)
    assert zero["digest"] == one["digest"] == state_digest(final_state(cfg, STEPS))
