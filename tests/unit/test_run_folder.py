"""The run folder's names and readers (`raytrain_ft.core.run_folder`), and the one fingerprint comparison
the driver's preflight and the restore share (`raytrain_ft.checkpoint.fingerprint.check_fingerprint`)."""

from __future__ import annotations

import json

import pytest

from raytrain_ft.checkpoint.fingerprint import check_fingerprint
from raytrain_ft.core.errors import CheckpointError
from raytrain_ft.core.run_folder import RAY_RUN_STATE, committed_steps, complete_steps, step_of, step_path


def test_complete_steps_are_the_step_folders_with_metadata_oldest_first(tmp_path):
    root = str(tmp_path / "run")
    for step, complete in ((10, True), (3, True), (5, False), (12, False)):
        (tmp_path / "run" / f"step-{step}").mkdir(parents=True)
        if complete:
            (tmp_path / "run" / f"step-{step}" / ".metadata").write_bytes(b"")
    (tmp_path / "run" / "step-x").mkdir()  # not a step folder
    assert complete_steps(root) == [3, 10]
    assert committed_steps(root) == [3, 10]  # no Ray run state: every complete one
    (tmp_path / "run" / RAY_RUN_STATE).write_text(
        json.dumps({"checkpoint_results": [{"checkpoint_dir_name": "step-3"}]})
    )
    assert committed_steps(root) == [3]
    assert step_of(step_path(root, 10)) == 10 and step_path(root + "/", 10) == f"{root}/step-10"
    assert complete_steps(str(tmp_path / "missing")) == []


WSD = {"train.max_steps": 20, "train.lr_schedule": "wsd", "train.decay_steps": 8, "train.seed": 0}


def test_one_comparison_passes_a_match_and_an_allowed_extension_and_refuses_the_rest():
    assert check_fingerprint("/r/step-12", WSD, dict(WSD)) is None
    assert check_fingerprint("/r/step-12", WSD, {**WSD, "train.max_steps": 30}) == 20  # decay starts after 12
    with pytest.raises(CheckpointError) as refused:  # the decay began at 12: the LR already fell
        check_fingerprint("/r/step-13", WSD, {**WSD, "train.max_steps": 30})
    assert str(refused.value).startswith("checkpoint /r/step-13 cannot continue to train.max_steps=30: the run's wsd")
    with pytest.raises(CheckpointError) as other:
        check_fingerprint("/r/step-12", WSD, {**WSD, "train.max_steps": 30, "train.seed": 1})
    assert str(other.value) == (
        "checkpoint /r/step-12 belongs to a different model or dataset (train.max_steps: checkpoint 20 vs config 30, "
        "train.seed: checkpoint 0 vs config 1); use the original settings or a new run.name"
    )
