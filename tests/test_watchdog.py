"""The driver's progress watchdog (`raytrain_ft.launch.progress_watchdog`) on frozen workers (real Ray),
in both recovery modes.

A `freeze` fault SIGSTOPs a rank's own process: every thread in it stops, so nothing inside the
rank can report; its peers wait for it in a collective. In ONE restart-mode run, three freezes in a
row, one per moment:

1. step 8, rank 1, right before the gradient reduction (rank 0 waits inside the all-reduce);
2. the next start, rank 0, as it restores the checkpoint of step 5 (rank 1 waits inside the restore);
3. step 15, rank 1, while its write of the checkpoint of step 15 is in flight (rank 0 trains on to
   the next all-reduce).

Each must end in a recorded failure (a `hang` event naming the frozen rank, its stacks from py-spy
in the run folder and in MLflow, the failure's cause the watchdog's) and a resumed run, bitwise
equal to the uninterrupted `reference` run, every step on the same sample ids. Four attempts start,
from 0, 5, 5 and 10; the second never completes its restore, and an attempt is recorded
(`attempt_start`) once restored, so the recorded resumes are 0, 5 and 10. The bounds are small here
(`failure.hang_timeout_s`; the start's freeze is found by liveness, `failure.liveness_timeout_s`, with
the start bound at its 20-minute default).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import assert_resumed, assert_same_state, events, final_state, first_steps_alone, make_config, run_root
from raytrain_ft.core.run_folder import replica_final_file
from raytrain_ft.data.audit import read_audit
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import window_sample_ids
from raytrain_ft.data.position import BatchPlan, DataPosition
from raytrain_ft.launch.driver import run
from raytrain_ft.resilience.recovery import failures
from raytrain_ft.resilience.replicas import state_digest

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.exclusive]

STEP_BOUND_S = 8  # this run's steps take about 0.1 s, its saves and restores under 2 s
# the start frozen in its restore is found dead by liveness (its process stopped for this long), not by the
# start bound, left at its default (1200 s): a slow start is not a dead one
LIVENESS_S = 15


@pytest.mark.timeout(600)
def test_a_worker_frozen_in_a_collective_at_a_start_and_in_a_save_is_stopped_and_the_run_resumes(
    tmp_path, dataset, reference
):
    freezes = (
        "faults=[{kind: freeze, at: reduce, step: 8, rank: 1}, {kind: freeze, at: start, step: 5, rank: 0},"
        " {kind: freeze, at: save, step: 15, rank: 1}]"
    )
    cfg = make_config(
        tmp_path,
        dataset,
        "run.name=frozen",
        "train.max_steps=30",
        "data.audit=true",
        "failure.max_failures=3",
        f"failure.hang_timeout_s={STEP_BOUND_S}",
        f"failure.liveness_timeout_s={LIVENESS_S}",
        freezes,
    )
    run_id = run(cfg)
    uri = cfg.tracking.uri
    assert_resumed(uri, run_id, [0, 5, 10])  # the start frozen in its restore is not recorded
    ref_cfg, _, ref_state = reference
    assert_same_state(final_state(cfg, 30), ref_state)
    assert read_audit(run_root(cfg)).equals(read_audit(run_root(ref_cfg)))

    # one hang per freeze, naming the frozen rank; the stacks say where each one stopped
    hangs = events(uri, run_id, "hang")
    assert [(h["ranks"], h["step"]) for h in hangs] == [([1], 7), ([0], None), ([1], 14)]
    client = MlflowClient(uri)
    where = ["before_reduce", "reader_for", "after_save_started"]
    folder = os.path.join(run_root(cfg), "hangs")
    files = sorted(os.listdir(folder), key=lambda n: os.path.getmtime(os.path.join(folder, n)))
    assert [n.split("-")[0] for n in files] == ["step7", "start", "step14"]
    for h, frozen_in, name in zip(hangs, where, files, strict=True):
        with open(client.download_artifacts(run_id, h["stack_dump"])) as f:
            dump = f.read()
        with open(os.path.join(folder, name)) as f:
            assert f.read() == dump  # the run folder's copy
        frozen = h["ranks"][0]
        assert f"rank {frozen} did not arrive" in dump.splitlines()[0]
        section = dump.split(f"--- rank {frozen} ")[1].split("--- rank")[0]
        assert "state T" in section and "Thread" in section and frozen_in in section  # py-spy's dump
        assert "--- rank 0 " in dump and "--- rank 1 " in dump  # every worker's stacks
        if frozen_in == "reader_for":  # dead by liveness: the bound and a poll or two, far below 1200 s
            assert LIVENESS_S <= h["stalled_s"] < 60 and "failure.liveness_timeout_s" in dump.splitlines()[0]
        else:
            assert h["stalled_s"] >= STEP_BOUND_S

    # each freeze is one counted failure, its cause the watchdog's for the frozen rank
    recorded = [f for _, f in failures(events(uri, run_id, "failure"))]
    assert len(recorded) == 3
    for f, h in zip(recorded, hangs, strict=True):
        assert "progress watchdog" in f["causes"][str(h["ranks"][0])], f["causes"]
    assert ["dead by liveness" in f["causes"][str(h["ranks"][0])] for f, h in zip(recorded, hangs, strict=True)] == [
        False,
        True,
        False,
    ]
    assert client.get_run(run_id).data.metrics["restarts"] == 3


# Replica test: the survivor trains alone, `SLOW_S` per step from the freeze on, until the replacement
# takes part in a step (`until_members: 2`), for up to `SLOW_STEPS` steps: longer than the replacement's
# start bound (`REPLICA_START_BOUND_S`, which the watchdog holds the replacement to; Ray Train group starts
# measured over 90 s on a loaded 2-core machine). A replacement that has not reached its first step by
# then is stopped, a second failure that ends the run. So the replacement joins before the survivor's
# last step (or the test fails loudly): the order is forced by the bound, not won in a race, and the
# test takes as long as the replacement's start, not the bound. Its step bound leaves room for a slow
# step plus the lighthouse's join window (`waits.LIGHTHOUSE_JOIN_S`, 10 s), which the survivor's quorum
# may wait once the replacement's Manager is up and before it asks to join.
FREEZE_STEP, SLOW_S, REPLICA_STEP_BOUND_S, REPLICA_START_BOUND_S = 6, 4.0, 20, 120
SLOW_STEPS = int(REPLICA_START_BOUND_S / SLOW_S) + 5  # the start bound plus 20 s of Ray's replacement
REPLICA_STEPS = FREEZE_STEP + SLOW_STEPS + 2


@pytest.mark.timeout(600)
def test_a_frozen_replica_is_stopped_and_replaced_while_the_other_trains_on(tmp_path, dataset):
    """Replica recovery: replica 1 freezes before its gradient all-reduce at step 6 (replica 0 waits
    inside it). The watchdog names replica 1 (its process is stopped), records the stacks and stops
    it; Ray Train replaces only replica 1, which restores the newest committed checkpoint and heals
    from replica 0, then trains with it. No restart: one attempt, from 0. Bitwise equality with a
    clean run does not apply here: the steps replica 0 trains alone sum the global batch's gradients
    in another order; what holds is each step's global batch, once, and replicas bitwise equal to
    each other and to the final checkpoint."""
    cfg = make_config(
        tmp_path,
        dataset,
        "run.name=frozen-replica",
        "failure.recovery=replica",
        f"train.max_steps={REPLICA_STEPS}",
        "checkpoint.interval_steps=4",
        "data.audit=true",
        "failure.max_failures=1",
        f"failure.hang_timeout_s={REPLICA_STEP_BOUND_S}",
        f"failure.start_timeout_s={REPLICA_START_BOUND_S}",
        f"faults=[{{kind: freeze, at: reduce, step: {FREEZE_STEP}, rank: 1}},"
        f" {{kind: slow, step: {FREEZE_STEP}, steps: {SLOW_STEPS}, rank: 0, seconds: {SLOW_S}, until_members: 2}}]",
    )
    run_id = run(cfg)
    uri, root = cfg.tracking.uri, run_root(cfg)
    assert_resumed(uri, run_id, [0])  # a replacement is not a restart
    [hang] = events(uri, run_id, "hang")
    assert (hang["ranks"], hang["step"]) == ([1], FREEZE_STEP - 1)
    with open(MlflowClient(uri).download_artifacts(run_id, hang["stack_dump"])) as f:
        section = f.read().split("--- rank 1 ")[1].split("--- rank")[0]
    assert "state T" in section and "before_reduce" in section
    [failure] = [f for _, f in failures(events(uri, run_id, "failure"))]
    assert failure["replaced"] == [1] and "progress watchdog" in failure["causes"]["1"]

    manifest, g = load_manifest(cfg.data.path), cfg.train.global_batch_size
    plan = BatchPlan(g, cfg.train.micro_batch_size, 1)
    expected = window_sample_ids(cfg.data.path, manifest, cfg.train.seed, DataPosition(), plan, REPLICA_STEPS)
    audit = read_audit(root).to_pydict()
    trained: dict[int, list[int]] = {}
    participants: dict[int, set[int]] = {}
    for step, rank, sample in zip(audit["step"], audit["rank"], audit["sample_id"], strict=True):
        trained.setdefault(step, []).append(sample)
        participants.setdefault(step, set()).add(rank)
    assert sorted(trained) == list(range(1, REPLICA_STEPS + 1))
    assert all(ids == expected[(s - 1) * g : s * g] for s, ids in trained.items())

    # the replacement restored a checkpoint committed before it started (the newest one the survivor
    # had committed by then: 4, before the freeze, or one the survivor wrote alone), healed from the
    # survivor and trained every step from the one it joined at, before the survivor's last
    [start] = events(uri, run_id, "replica_start")
    [joined] = events(uri, run_id, "replica_joined")
    restored, joined_at = start["resumed_from"], joined["step"]
    committed = {
        m.step for m in MlflowClient(uri).get_metric_history(run_id, "wall_s") if m.timestamp / 1000 < start["time"]
    }
    assert start["replica"] == joined["replica"] == 1 and restored % 4 == 0 and restored in committed
    assert 4 <= restored < joined_at < REPLICA_STEPS, (restored, joined_at)
    alone = {s for s, ranks in participants.items() if len(ranks) == 1}
    # and the attempt's first steps if replica 0 formed its first quorum alone (replica 1 started late)
    degraded = set(range(FREEZE_STEP, joined_at))
    assert degraded <= alone <= degraded | first_steps_alone(alone, 0), sorted(alone)
    assert all(participants[s] == {0, 1} for s in range(joined_at, REPLICA_STEPS + 1))
    digests = [json.loads(Path(replica_final_file(root, r)).read_text()) for r in (0, 1)]
    assert digests[0]["step"] == digests[1]["step"] == REPLICA_STEPS
    assert digests[0]["digest"] == digests[1]["digest"] == state_digest(final_state(cfg, REPLICA_STEPS))
