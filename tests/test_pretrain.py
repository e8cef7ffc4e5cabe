"""Whole runs of 2 ranks, tiny Llama, real DCP files, SQLite MLflow: the uninterrupted reference and a
corrupt-checkpoint fallback on the Ray-free session (`tests/local_run.py`), and the driver's one-line
refusal of a run folder without Ray's run state on a real local Ray instance (another model's
checkpoint: test_jobs.py, as a user submits it)."""

from __future__ import annotations

import shutil

import pytest
from mlflow.tracking import MlflowClient

from conftest import (
    assert_kept_timeline,
    assert_resumed,
    assert_same_state,
    events,
    final_state,
    flip_bit,
    make_config,
    metric_by_step,
    run_root,
    uninterrupted_lrs,
)
from local_run import LocalRunFailed, local_run
from raytrain_ft.checkpoint.integrity import verify_checkpoint
from raytrain_ft.core.errors import CheckpointError
from raytrain_ft.core.run_folder import committed_steps, read_run_id, step_path
from raytrain_ft.launch.driver import run


def test_an_uninterrupted_run_completes_and_loss_falls(reference):
    cfg, run_id, _ = reference
    losses = metric_by_step(cfg, run_id, "train/loss")
    assert sorted(losses) == list(range(1, 31)) and losses[30] < losses[1]
    assert metric_by_step(cfg, run_id, "train/lr") == uninterrupted_lrs(cfg.train)  # what resumed runs are held to
    assert MlflowClient(cfg.tracking.uri).get_run(run_id).info.status == "FINISHED"


def test_a_flipped_bit_in_the_committed_checkpoint_falls_back_to_the_previous_one(tmp_path, dataset, reference):
    # bit rot in the largest model tensor of the newest committed checkpoint, after the job died: the
    # resubmission must not train on it (the flip is placed through the checkpoint's own DCP metadata;
    # flips in the optimizer, the data position and .metadata: tests/unit/test_integrity.py)
    # (on the Ray-free session, `tests/local_run.py`: the fallback is the loop's)
    faults = "faults=[{kind: raise, step: 23, rank: 0}]"
    cfg = make_config(tmp_path, dataset, "train.max_steps=30", "failure.max_failures=0", faults)
    with pytest.raises(LocalRunFailed, match="InjectedFault"):
        local_run(cfg)
    # its status from the driver's owner (`tracking.finish_run`), not set by the local runner
    assert MlflowClient(cfg.tracking.uri).get_run(read_run_id(run_root(cfg))).info.status == "FAILED"
    latest = step_path(run_root(cfg), committed_steps(run_root(cfg))[-1])  # a local run prunes nothing: 5-20 stay
    assert latest.endswith("step-20")
    flip_bit(latest, "model.model.embed_tokens.weight")
    assert [s for s in committed_steps(run_root(cfg)) if verify_checkpoint(step_path(run_root(cfg), s))] == [20]
    cfg = make_config(tmp_path, dataset, "train.max_steps=30", faults)  # resubmit: same run, fault already fired
    run_id = local_run(cfg)
    assert_resumed(cfg.tracking.uri, run_id, [0, 15])  # the first submission, then the fallback to 15
    [corrupt] = events(cfg.tracking.uri, run_id, "corrupt_checkpoint")
    assert corrupt["path"].endswith("step-20") and "model.model.embed_tokens.weight" in corrupt["reason"]
    assert "step-20" in MlflowClient(cfg.tracking.uri).get_run(run_id).data.tags["last_corrupt_checkpoint"]
    assert_same_state(final_state(cfg, 30), reference[2])
    # steps 16-20 ran twice (kept values from the first submission, equal re-run values not logged
    # again); only 21-22 were lost
    assert_kept_timeline(cfg, run_id, reference[0], reference[1], discarded=[21, 22], rerun_kept=(16, 17, 18, 19, 20))


@pytest.mark.parametrize("fault", ["raise, at: save", "kill, at: write", "kill, at: metadata"])
def test_a_failure_while_a_save_is_written_resumes_from_the_previous_commit_and_deletes_the_cut_save(
    tmp_path, dataset, reference, fault
):
    # rank 0 fails in its save of step 20, the save neither finished nor committed (a fault in a save
    # does not settle first): raises 0.5 s into its (slowed) write, before its first byte (`save`);
    # SIGKILLed with its file cut short (`write`), or once every shard is written, before `.metadata`
    # (`metadata`; where each cut lands: tests/unit/test_cut_writes.py). 15, committed before 20's write
    # started, is where the restart resumes; the cut save is deleted, never loaded (Ray-free session)
    cfg = make_config(tmp_path, dataset, "train.max_steps=30", f"faults=[{{kind: {fault}, step: 20, rank: 0}}]")
    run_id = local_run(cfg)
    assert_resumed(cfg.tracking.uri, run_id, [0, 15])
    [deleted] = events(cfg.tracking.uri, run_id, "uncommitted_checkpoints_deleted")
    assert deleted["steps"] == [20]
    # the step-20 there now is the re-trained one, and the run ends on the reference's bits
    assert_same_state(final_state(cfg, 20), final_state(reference[0], 20))
    assert_same_state(final_state(cfg, 30), reference[2])
    assert MlflowClient(cfg.tracking.uri).get_run(run_id).info.status == "FINISHED"


def test_a_collective_stuck_past_its_bound_fails_the_attempt_and_the_restart_resumes(tmp_path, dataset, reference):
    # rank 1 holds 15 s before its step-9 reduction; rank 0 waits in the step's next collective until
    # failure.collective_timeout_s (5 s) ends it with an error: the attempt fails, the restart (one of
    # failure.max_failures) resumes from 5, and the run ends on the reference's bits. Without the bound
    # rank 0 would wait the hold out and the run would never restart.
    hold = "faults=[{kind: hold_reduce, step: 9, rank: 1, seconds: 15}]"
    cfg = make_config(tmp_path, dataset, "train.max_steps=30", "failure.collective_timeout_s=5", hold)
    run_id = local_run(cfg)
    assert_resumed(cfg.tracking.uri, run_id, [0, 5])
    assert_same_state(final_state(cfg, 30), reference[2])


@pytest.mark.usefixtures("ray_local")
def test_checkpoints_without_rays_run_state_are_kept_and_refused_in_one_line(tmp_path, dataset, reference):
    ref_cfg = reference[0]
    cfg = make_config(tmp_path, dataset, "run.name=orphan", "train.max_steps=30")
    shutil.copytree(step_path(run_root(ref_cfg), 30), step_path(run_root(cfg), 30))  # no Ray run state beside it
    with pytest.raises(CheckpointError) as e:
        run(cfg)
    message = str(e.value)
    assert "\n" not in message and "(steps 30) but no checkpoint_manager_snapshot.json" in message
    assert_same_state(final_state(cfg, 30), reference[2])  # nothing was deleted
