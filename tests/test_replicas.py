"""Replica recovery (`failure.recovery: replica`, torchft): replicas killed in the gradient all-reduce,
during a durable checkpoint's write, and all at once, plus a NaN on one replica, in ONE run; the run
keeps the project's guarantees per committed step.

Two replicas (2 CPU workers, gloo, the tiny preset), a checkpoint every 4 steps, every step from
`hold_step` on at least 1 s (a `slow` fault, every pass) so the survivor is still training when Ray
Train's replacement arrives and heals from it, and the run is still training when the test kills
both replicas. In order (the seed, `REPLICA_SEED`, picks the moments):

1. step `NAN_STEP`: replica 1's loss is NaN (a `nan` fault): every replica must skip that step;
2. step `hold_step`: replica 1 holds before its gradient reduction (a `hold_reduce` fault, marker
   first) while replica 0 waits inside the all-reduce; the test SIGKILLs replica 1 a seeded
   moment into the hold: the step must not commit and replica 0 trains it again, alone;
3. step `SAVE_KILL_STEP`: replica 0, the saver, is SIGKILLed 0.5 s into its checkpoint write (a
   `kill` fault at `save`): no deadlock, the partial checkpoint is never committed nor loaded;
4. once the checkpoint of `resume_step` is committed (and its goodput recorded, which `assert_resumed`
   reads as the proof of the commit) and a memory-tier copy of a later step (`checkpoint.memory`,
   every 2 steps, written by the step's saver) is committed, the test SIGKILLs both replicas: no live
   peer is left to heal from, Ray Train restarts the whole group, and every replica restores the
   newest memory copy (`restored_from: memory`), not `resume_step`. The replacements of 2. and 3.
   restore the newest checkpoint of either tier, then heal from the live replica.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from conftest import (
    BackgroundRun,
    copy_steps,
    events,
    final_state,
    first_steps_alone,
    make_config,
    metric_by_step,
    run_root,
    uninterrupted_lrs,
    wait_for,
)
from local_run import local_run
from raytrain_ft.cli import main as cli
from raytrain_ft.core.run_folder import (
    complete_steps,
    fault_marker,
    read_latest,
    replica_final_file,
    step_path,
    worker_records,
)
from raytrain_ft.data.audit import read_audit
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import window_sample_ids
from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.launch.driver import run
from raytrain_ft.resilience.recovery import KILLED, recovery_rows, replacement_rows
from raytrain_ft.resilience.replicas import state_digest
from raytrain_ft.telemetry.tracking import MlflowRecorder, steps_logged_since

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.exclusive]

SEED = int(os.environ.get("REPLICA_SEED", "5"))
STEPS = 46
NAN_STEP = 6
SAVE_KILL_STEP = 24
HOLD_S = 4.0
# what the replica run and its reference share; no dropout: a replica alone trains the other
# replica's sequences too, and dropout's mask would be drawn on another rank than the reference's
SAME_VALUES = [f"train.max_steps={STEPS}", "checkpoint.interval_steps=4", "model.dropout=0.0"]
# measured: at most 6e-8 apart (float order); a step trained on stale gradients is far outside this
REF_RTOL, REF_ATOL = 1e-5, 1e-6
NAN = f"{{kind: nan, step: {NAN_STEP}, rank: 1}}"


def final_digest(root: str, replica: int) -> dict:
    return json.loads(Path(replica_final_file(root, replica)).read_text())


def current_workers(root: str) -> dict[int, dict]:
    records = worker_records(root, 2, 0.0)
    assert records is not None
    return records


def replaced_since(root: str, replica: int, since: float) -> dict[int, dict] | None:
    """Both replicas' worker records once `replica`'s process started after unix time `since`."""
    records = worker_records(root, 2, 0.0)
    return records if records and records[replica]["started_at"] > since else None


@pytest.mark.timeout(900)
def test_replicas_killed_in_the_all_reduce_in_a_save_and_all_at_once_keep_every_step(tmp_path, dataset, capsys):
    rng = random.Random(SEED)
    hold_step, kill_into_hold_s, resume_step = rng.randint(10, 12), rng.uniform(0.3, 2.5), rng.choice([36, 40])
    faults = [
        f"{{kind: slow, step: {hold_step}, steps: {STEPS - hold_step + 1}, rank: -1, seconds: 1.0}}",
        NAN,
        f"{{kind: hold_reduce, step: {hold_step}, rank: 1, seconds: {HOLD_S}}}",
        f"{{kind: kill, at: save, step: {SAVE_KILL_STEP}, rank: 0}}",
        # a survivor alone takes 5 s a step until the replacement takes part (`until_members: 2`): each
        # replacement joins within its window (before SAVE_KILL_STEP, by resume_step) even if its start
        # takes a minute under load (replica 1's once joined at step 24 at 1 s a step)
        f"{{kind: slow, step: {hold_step}, steps: {STEPS - hold_step + 1}, rank: -1, seconds: 4.0, until_members: 2}}",
    ]
    memory_dir = tmp_path / "shm"
    cfg = make_config(
        tmp_path,
        dataset,
        "failure.recovery=replica",
        *SAME_VALUES,
        "data.audit=true",
        "failure.max_failures=4",
        f"faults=[{', '.join(faults)}]",
        "checkpoint.memory.interval_steps=2",
        f"checkpoint.memory.dir={memory_dir}",
    )
    root = run_root(cfg)
    trainer = BackgroundRun(run, cfg)
    run_id_file = Path(root, "mlflow_run_id")
    run_id = wait_for("the MLflow run", lambda: run_id_file.exists() and run_id_file.read_text().strip(), trainer)
    first = wait_for("both replicas", lambda: worker_records(root, 2, 0.0), trainer)

    # 2. replica 1 holds before the gradient all-reduce of hold_step: kill it a seeded moment into the hold
    wait_for(f"replica 1 holding at step {hold_step}", Path(fault_marker(root, 2, hold_step)).exists, trainer)
    time.sleep(kill_into_hold_s)
    os.kill(first[1]["pid"], signal.SIGKILL)
    killed_in_reduce = time.time()
    # 3. the loop kills replica 0 itself while it writes the checkpoint of SAVE_KILL_STEP
    save_kill = Path(fault_marker(root, 3, SAVE_KILL_STEP))
    wait_for(f"replica 0's kill during the save of step {SAVE_KILL_STEP}", save_kill.exists, trainer)
    second = current_workers(root)  # replica 1's replacement, and replica 0 (dead or not yet replaced)
    third = wait_for("replica 0's replacement", lambda: replaced_since(root, 0, float(save_kill.read_text())), trainer)
    # 4. every replica, once the checkpoint of resume_step is committed
    client = MlflowClient(cfg.tracking.uri)

    def recorded_commit() -> bool:  # in the run folder, and its goodput recorded (what `assert_resumed` reads)
        committed = read_latest(root) == step_path(root, resume_step)
        return committed and resume_step in {m.step for m in client.get_metric_history(run_id, "wall_s")}

    wait_for(f"the commit of step {resume_step}", recorded_commit, trainer)
    wait_for(
        f"a memory copy newer than step {resume_step}",
        lambda: max(copy_steps(memory_dir), default=0) > resume_step,
        trainer,
    )
    before_all = current_workers(root)
    for replica in (0, 1):
        os.kill(before_all[replica]["pid"], signal.SIGKILL)
    killed_all = time.time()
    in_memory = max(copy_steps(memory_dir))  # the newest copy committed at the kill

    assert trainer.finished() == run_id
    last = current_workers(root)
    # Ray Train replaced only the killed replica each time; the survivor kept its process
    assert second[0]["pid"] == first[0]["pid"] and second[1]["started_at"] > killed_in_reduce
    assert third[1] == second[1] and third[0]["pid"] != first[0]["pid"]
    assert before_all == third and all(last[r]["started_at"] > killed_all for r in (0, 1))
    # the restart of every replica resumed from the newest memory copy committed (its `COMMITTED` marker
    # written) at the kill, newer than the durable checkpoint; its goodput record may have died with it
    attempts = [(a["resumed_from"], a["restored_from"]) for a in events(cfg.tracking.uri, run_id, "attempt_start")]
    assert attempts == [(0, ""), (in_memory, "memory")]

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

    evs = MlflowRecorder(cfg.tracking.uri, run_id).events()
    by_kind: dict[str, list[dict]] = {k: [] for k in ("step_not_committed", "replica_joined", "replica_start")}
    for e in evs:
        by_kind.setdefault(e["kind"], []).append(e)
    # the step replica 1 was killed in did not commit on replica 0, which trained it again alone
    assert [(e["replica"], e["step"], e["participants"]) for e in by_kind["step_not_committed"]] == [(0, hold_step, 2)]
    joined = {e["replica"]: e["step"] for e in by_kind["replica_joined"]}
    assert sorted(joined) == [0, 1] and hold_step < joined[1] < SAVE_KILL_STEP < joined[0] <= resume_step
    # the steps trained with one replica: the survivor's until each replacement joined, and the first
    # steps of an attempt if one replica formed its first quorum alone (the other started later than
    # the lighthouse's join window, under load)
    alone = {s for s, ranks in participants.items() if len(ranks) == 1}
    degraded = set(range(hold_step, joined[1])) | set(range(SAVE_KILL_STEP + 1, joined[0]))
    first = first_steps_alone(alone, 0) | first_steps_alone(alone, in_memory)
    assert degraded <= alone and alone - degraded <= first, sorted(alone)
    # the replacements restored a committed checkpoint (never the partial one of SAVE_KILL_STEP), then healed
    restored = {e["replica"]: e["resumed_from"] for e in by_kind["replica_start"]}
    assert restored.keys() == {0, 1} and restored[1] < joined[1] and SAVE_KILL_STEP - 4 <= restored[0] < joined[0]
    assert SAVE_KILL_STEP not in restored.values()  # a durable checkpoint or a memory copy, never the cut save
    assert SAVE_KILL_STEP not in complete_steps(root)  # the killed write never completed (pruned since)

    # the NaN on replica 1 alone: every replica skipped that step, and only that one
    assert participants[NAN_STEP] == {0, 1}
    assert [e["step"] for e in by_kind["skipped_step"]] == [NAN_STEP]
    zero, one = final_digest(root, 0), final_digest(root, 1)
    assert zero["skipped"] == one["skipped"] == 1
    # metrics for every step, whichever replica was rank 0 of its quorum; the LR is the schedule's
    assert metric_by_step(cfg, run_id, "train/lr") == uninterrupted_lrs(cfg.train)
    # both replicas ended bitwise equal to each other and to the final checkpoint
    assert zero["step"] == one["step"] == STEPS
    assert read_latest(root) == step_path(root, STEPS)
    assert zero["digest"] == one["digest"] == state_digest(final_state(cfg, STEPS))
    # and to the same run with no failure (restart mode, Ray-free, the NaN alone), within float order:
    # the steps a replica trained alone summed the global batch's gradients in another order
    ref_cfg = make_config(tmp_path / "reference", dataset, *SAME_VALUES, f"faults=[{NAN}]")
    local_run(ref_cfg)
    got, ref = final_state(cfg, STEPS), final_state(ref_cfg, STEPS)
    assert got.keys() == ref.keys() and any(k.startswith("optim.") for k in got)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=REF_RTOL, atol=REF_ATOL, msg=lambda m, k=k: f"{k}: {m}")

    # the recovery history: one row per replacement, one restart; the goodput ledger's replacement part
    rows = replacement_rows(evs, steps_logged_since(client, run_id, 0.0))
    assert [(r["replica"], r["cause"], r["last_step"]) for r in rows] == [
        (1, f"rank 1: {KILLED}", hold_step - 1),
        (0, f"rank 0: {KILLED}", SAVE_KILL_STEP),
    ]
    for r, replica in zip(rows, (1, 0), strict=True):
        assert 0 < r["survivors_committed_s"] < r["replacement_restored_s"] < r["replacement_joined_s"], r
        assert (r["restored_from"], r["joined_step"], r["participants"]) == (restored[replica], joined[replica], 2)
    [restart] = recovery_rows(evs)
    assert (restart["resumed_from"], restart["restored_from"], restart["world_size_after"]) == (in_memory, "memory", 1)
    assert cli(["history", run_id, "--tracking-uri", cfg.tracking.uri]) == 0
    assert "Replica replacements" in capsys.readouterr().out
    with open(client.download_artifacts(run_id, "goodput_summary.json")) as f:
        goodput = json.load(f)
    # every kept step from hold_step on sleeps 1.0 s in its compute (the `slow` fault) and is productive,
    # degraded ones included, but for the three steps a failure struck, whose wait may be replacement;
    # the steps before hold_step are fast and not counted
    slow_kept = STEPS - hold_step + 1 - 3
    assert goodput["badput_replacement_s"] > 2.0 and goodput["productive_s"] > slow_kept * 1.0, goodput
    assert abs(goodput["unaccounted_s"]) < 1.0, goodput
