"""`raytrain-ft extend` against a real SQLite MLflow store and real DCP checkpoint folders written
here (no Ray, no process group): what it records, and the one-line refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from mlflow.tracking import MlflowClient

from conftest import events
from raytrain_ft.checkpoint.integrity import ChecksummedWriter
from raytrain_ft.checkpoint.train_state import KEY_META, RunMeta
from raytrain_ft.cli import main
from raytrain_ft.core.run_folder import read_extensions, step_path
from raytrain_ft.telemetry.tracking import start_or_resume_run

WSD_20 = {"train.max_steps": 20, "train.lr_schedule": "wsd", "train.decay_steps": 4, "train.warmup_steps": 5}


@pytest.fixture
def store(tmp_path):
    """(tracking URI, run folder) of an MLflow run named `demo` whose params name its folder."""
    uri, storage = f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "runs")
    root = os.path.join(storage, "demo")
    start_or_resume_run(uri, "raytrain-ft", root, "demo", {"run.storage_path": storage, "run.name": "demo"})
    return uri, root


def write_checkpoint(root: str, step: int, fingerprint: dict) -> None:
    """A complete checkpoint folder holding only the run metadata (all `extend` reads)."""
    dcp.save({KEY_META: RunMeta(fingerprint)}, storage_writer=ChecksummedWriter(step_path(root, step)), no_dist=True)


def test_extend_records_the_new_target_in_the_run_folder_and_mlflow(store, capsys):
    uri, root = store
    write_checkpoint(root, 8, WSD_20)
    write_checkpoint(root, 12, WSD_20)  # the newest decides
    assert main(["extend", "demo", "--max-steps", "30", "--tracking-uri", uri]) == 0
    assert "now extended to 30; resubmit it with train.max_steps=30" in capsys.readouterr().out
    [record] = read_extensions(root)
    assert {k: record[k] for k in ("at_step", "from_max_steps", "max_steps")} == {
        "at_step": 12,
        "from_max_steps": 20,
        "max_steps": 30,
    }
    run_id = Path(root, "mlflow_run_id").read_text()
    [event] = events(uri, run_id, "extended")
    assert (event["at_step"], event["from_max_steps"], event["max_steps"]) == (12, 20, 30)
    assert MlflowClient(uri).get_run(run_id).data.tags["max_steps"] == "30"


@pytest.mark.parametrize(
    ("step", "fingerprint", "reason"),
    [
        (17, WSD_20, "the run's wsd decay began after step 16 of 20 and its checkpoint is at step 17"),
        (12, {**WSD_20, "train.lr_schedule": "cosine"}, "the run uses train.lr_schedule=cosine"),
    ],
)
def test_extend_during_the_decay_or_of_a_cosine_run_is_refused_in_one_line(store, capsys, step, fingerprint, reason):
    uri, root = store
    write_checkpoint(root, step, fingerprint)
    assert main(["extend", "demo", "--max-steps", "30", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: cannot extend {root} to train.max_steps=30: {reason}")
    assert read_extensions(root) == []  # nothing recorded
    assert not os.path.exists(os.path.join(root, "extensions.json"))


def test_extend_of_an_unknown_run_or_one_without_a_checkpoint_is_refused_in_one_line(store, capsys):
    uri, root = store
    assert main(["extend", "nope", "--max-steps", "30", "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err.startswith("error: no run 'nope': not a run folder, nor an MLflow run id")
    assert main(["extend", "demo", "--max-steps", "30", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no complete checkpoint" in err
    assert read_extensions(root) == []


def test_a_checkpoint_written_before_lr_schedule_existed_reads_as_the_cosine_it_was():
    meta = RunMeta(fingerprint={})
    meta.load_state_dict({"json": json.dumps({"fingerprint": {"train.max_steps": 20}, "mlflow_run_id": "r"})})
    assert meta.fingerprint == {"train.max_steps": 20, "train.lr_schedule": "cosine", "train.decay_steps": 0}
    assert meta.history == []


def test_runs_shows_the_restarts_metric_and_the_extended_target(store, capsys):
    # the `restarts` metric is what Ray's recovery totals log (`MlflowRecorder.write_recovery_tables`);
    # test_extend.py's runs train on the Ray-free session, which records no failures, so it is set here
    uri, root = store
    run_id = Path(root, "mlflow_run_id").read_text()
    client = MlflowClient(uri)
    for key, value in (("restarts", 1.0), ("last_step", 30.0), ("train/loss", 2.5), ("goodput", 0.75)):
        client.log_metric(run_id, key, value, step=0)
    client.set_tag(run_id, "max_steps", "30")
    assert main(["runs", "--tracking-uri", uri]) == 0
    [row] = [line for line in capsys.readouterr().out.splitlines() if line.count("│") == 8]
    assert [c.strip() for c in row.split("│")[1:-1]] == ["demo", "RUNNING", "30/30", "2.5000", "", "1", "0.750"]
