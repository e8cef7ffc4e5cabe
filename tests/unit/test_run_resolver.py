"""`raytrain_ft.telemetry.run_resolver.find_run`, the one way every command finds RUN, against a real SQLite
MLflow store and run folders written here (no Ray): a run folder, an MLflow run id and a run name
name the same run for every command; a miss or an ambiguous name is one line saying what to pass."""

from __future__ import annotations

import json

import pytest

from conftest import sqlite_store
from raytrain_ft.cli import main
from raytrain_ft.telemetry.run_resolver import FoundRun, find_run
from raytrain_ft.telemetry.tracking import start_or_resume_run


def submitted(uri: str, storage: str, name: str) -> tuple[str, str]:
    """(run folder, MLflow run id) of a run submitted as the driver does (its params name its folder)."""
    root = f"{storage}/{name}"
    return root, start_or_resume_run(uri, "raytrain-ft", root, name, {"run.storage_path": storage, "run.name": name})


@pytest.fixture
def store(tmp_path):
    """(tracking URI, the run `demo`'s folder and id, the two runs named `twin`'s ids)."""
    uri = sqlite_store(tmp_path)
    root, run_id = submitted(uri, str(tmp_path / "runs"), "demo")
    twins = [submitted(uri, str(tmp_path / where), "twin")[1] for where in ("a", "b")]  # one run.name, two storages
    return uri, root, run_id, twins


def test_a_folder_an_id_and_a_name_find_the_same_run(store):
    uri, root, run_id, _ = store
    assert find_run(root, uri) == FoundRun(root, run_id, None)  # a folder: the store is not opened
    assert find_run(root + "/", "sqlite:////no/such/store.db").root == root
    for by in (run_id, "demo"):
        assert find_run(by, uri) == FoundRun(root, run_id, uri)


@pytest.mark.parametrize("by", ["folder", "id", "name"])
def test_every_command_finds_the_run_the_same_way(store, tmp_path, capsys, by):
    uri, root, run_id, _ = store
    run = {"folder": root, "id": run_id, "name": "demo"}[by]
    assert main(["history", run, "--json", "--tracking-uri", uri]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["id"] == run_id
    # the commands that read the run folder reach the same folder (no checkpoint in it yet)
    assert main(["verify", run, "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err == f"error: no committed checkpoints in {root}\n"
    assert main(["export", run, "--step", "3", "--out", str(tmp_path / "hf"), "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err == f"error: {root} has no complete checkpoint at step 3; complete steps: none\n"
    assert main(["extend", run, "--max-steps", "30", "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err.startswith(f"error: {root} holds no complete checkpoint")
    assert main(["plan-goodput", "--from-run", run, "--tracking-uri", uri, "--repetitions", "2"]) == 2
    assert "logged no step times" in capsys.readouterr().err  # found, but it measured nothing yet


def test_an_ambiguous_name_or_a_miss_is_one_line_saying_what_to_pass(store, tmp_path, capsys):
    uri, _, _, twins = store
    assert main(["history", "twin", "--tracking-uri", uri]) == 2
    assert (
        capsys.readouterr().err
        == f"error: 2 MLflow runs in {uri} are named 'twin' ({', '.join(sorted(twins))}): pass one id\n"
    )
    assert main(["history", twins[1], "--json", "--tracking-uri", uri]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["id"] == twins[1]

    assert main(["verify", "nope", "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err == (
        f"error: no run 'nope': not a run folder, nor an MLflow run id or run name in {uri}; pass the run folder "
        "(run.storage_path/run.name), an MLflow run id, or a run name `raytrain-ft runs` lists, or point "
        "--tracking-uri (or MLFLOW_TRACKING_URI) at the store the run logged to\n"
    )
    never_submitted = tmp_path / "copied"  # a run folder without a run id file
    never_submitted.mkdir()
    assert main(["history", str(never_submitted), "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: the run folder {never_submitted} names no MLflow run")
