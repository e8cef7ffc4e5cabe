"""Where runs track to: MLFLOW_TRACKING_URI, the embedded server on a multi-node cluster, and paths
that would land in Ray's temporary working-dir copy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import ray
from mlflow.tracking import MlflowClient
from ray.train import WorkerGroupError
from ray.train.v2._internal.execution.controller.state import RestartingState, RunningState

from conftest import REPO, BackgroundRun, events, make_config, run_root, run_scenario, sqlite_store, wait_for
from local_run import local_run
from raytrain_ft.cli import main
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.core.run_folder import read_latest, step_path
from raytrain_ft.launch.callbacks import FailureRecorder
from raytrain_ft.launch.recorder_actor import RemoteRecorder, close, start_recorder_actor
from raytrain_ft.launch.tracking_server import lasting_path, mlflow_server
from raytrain_ft.telemetry.tracking import MlflowRecorder, start_or_resume_run


def test_history_of_an_unknown_run_is_one_line_naming_the_store(tmp_path, monkeypatch, capsys):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    os.makedirs(tmp_path / "run")
    start_or_resume_run(uri, "raytrain-ft", str(tmp_path / "run"), "known", {})
    assert main(["history", "known"]) == 0  # found through MLFLOW_TRACKING_URI
    assert capsys.readouterr().out.startswith("run known (")
    assert main(["history", "unknown"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"error: no run 'unknown': not a run folder, nor an MLflow run id or run name in {uri}")
    assert "raytrain-ft runs" in err and "--tracking-uri" in err  # how to fix it


def test_a_relative_path_inside_rays_working_dir_copy_is_refused_in_one_line(tmp_path, monkeypatch):
    package = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    package.mkdir(parents=True)
    monkeypatch.chdir(package)
    with pytest.raises(ConfigError) as e:
        lasting_path("runs", "run.storage_path")
    assert str(e.value) == (
        f"run.storage_path=runs would resolve to {package}/runs, inside Ray's temporary copy of --working-dir, "
        "which Ray deletes; give an absolute path or a URL every node reaches"
    )
    assert lasting_path("/data/runs", "run.storage_path") == "/data/runs"
    assert lasting_path("s3://b/runs", "run.storage_path") == "s3://b/runs"
    monkeypatch.chdir(tmp_path)
    assert lasting_path("runs", "run.storage_path") == f"{tmp_path}/runs"


def test_without_a_uri_every_node_reaches_the_tracking_server_with_the_jobs_credentials_only(tmp_path):
    outcome = run_scenario("tracking_cluster.py", str(tmp_path), timeout_s=600)
    # an mlflow server on the head's cluster-internal address, not a per-node SQLite path
    assert outcome["uri"].startswith(f"http://{outcome['head_address']}:")
    assert outcome["head_address"] not in ("0.0.0.0", "")
    assert len(outcome["nodes"]) == 2
    assert sorted(p["node"] for p in outcome["reached"]) == sorted(outcome["nodes"])
    # each node's artifact went through the server into the head's folder
    assert all(p["artifact_uri"].startswith("mlflow-artifacts:/") for p in outcome["reached"])
    # ... and the store is the default one, in the driver's home folder
    assert len(list((tmp_path / "raytrain-ft" / "mlartifacts").rglob("probe.txt"))) == 2
    assert (tmp_path / "raytrain-ft" / "mlflow.db").exists()
    # the nodes logged with the credentials of the job's runtime env; without them: refused
    assert outcome["refused"] == 401


def test_training_workers_do_not_import_mlflow():
    # A restarted worker imports the train function's modules, and those of the RunConfig's callbacks,
    # on the recovery's critical path; MLflow (~0.8 s of CPU, ~1.7 s with a SQLite store) lives in
    # the run's RecorderActor instead.
    code = (
        "import sys, raytrain_ft.launch.worker, raytrain_ft.launch.callbacks; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_the_remote_recorder_keeps_call_order_and_the_callers_timestamps(tmp_path, ray_local):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = start_or_resume_run(uri, "remote-recorder", str(tmp_path / "run"), "remote-recorder", {})
    earlier = MlflowRecorder(uri, run_id)
    earlier.event("failure", causes={"0": "x"}, last_step=0, time=1.0)  # an earlier submission's
    earlier.drain()
    actor = start_recorder_actor(uri, run_id)
    recorder = RemoteRecorder(actor)
    t0 = 1_700_000_000.0  # the caller's clock, not the actor's
    for step in (1, 2, 3):  # none of these calls waits
        recorder.record_step(step, {"loss": float(step)}, {"last_step": step}, at=t0 + step)
    recorder.committed(2)
    recorder.event("rollback", at_step=3, time=t0 + 3.5)
    recorder.event("probe", step=3)  # not a control event: not in the history
    # the history the actor serves: the store's at its start, then each event in call order
    history = ray.get(actor.history.remote())
    assert [(e["kind"], e["time"]) for e in history.events] == [("failure", 1.0), ("rollback", t0 + 3.5)]
    assert history.run_start == MlflowClient(uri).get_run(run_id).info.start_time / 1000
    recorder.registered()  # waited: every committed step is on the kept timeline
    client = MlflowClient(uri)
    live = sorted((m.step, m.timestamp) for m in client.get_metric_history(run_id, "train_live/loss"))
    assert live == [(s, int((t0 + s) * 1000)) for s in (1, 2, 3)]
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2]
    close(actor)


def test_a_tracking_failure_never_stops_a_restart(tmp_path, ray_local, caplog):
    # Ray Train ends the run when a controller callback raises: a dead recorder actor must not
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    actor = start_recorder_actor(uri, start_or_resume_run(uri, "dead-actor", str(tmp_path / "run"), "dead-actor", {}))
    ray.kill(actor, no_restart=True)
    restarting = RestartingState(WorkerGroupError("rank 1 failed", {1: RuntimeError("boom")}))
    FailureRecorder(actor).after_controller_state_update(RunningState(), restarting)
    assert "failure (rank 1: RuntimeError: boom) not recorded in MLflow" in caplog.text


def test_a_tracking_server_stopped_mid_run_stalls_no_step_and_loses_no_record(tmp_path, dataset):
    # A real `mlflow server`, stopped after step 3 and started again on the same port and SQLite
    # store only once the run's last checkpoint is committed: every step trained while it was away.
    backend, artifacts = sqlite_store(tmp_path), str(tmp_path / "mlartifacts")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = make_config(
        tmp_path,
        dataset,
        "run.name=outage",
        "train.max_steps=30",
        "waits.tracking_timeout_s=2",
        "faults=[{kind: nan, step: 15, rank: 1}, {kind: slow, step: 4, steps: 6, seconds: 0.5}]",
    )
    with mlflow_server(backend, artifacts, "127.0.0.1", port) as url:
        cfg.tracking.uri = url
        trainer = BackgroundRun(local_run, cfg)
        client = MlflowClient(url)
        wait_for("step 3 in the store", lambda: _last_step(client, cfg) >= 3, trainer)
    root = run_root(cfg)
    wait_for("step 30 committed without the server", lambda: read_latest(root) == step_path(root, 30), trainer)
    with mlflow_server(backend, artifacts, "127.0.0.1", port) as url:
        client, run_id = MlflowClient(url), trainer.finished(timeout_s=300)
        steps = list(range(1, 31))
        for key in ("train/loss", "train/lr", "train_live/loss"):
            assert sorted(m.step for m in client.get_metric_history(run_id, key)) == steps, key
        assert [e["step"] for e in events(url, run_id, "skipped_step")] == [15]  # recorded while it was away
        (outage,) = events(url, run_id, "tracking_outage")
        assert outage["held"] > 0  # records waited in the outbox; the steps did not wait on the server
        assert client.get_run(run_id).info.status == "FINISHED"


def _last_step(client: MlflowClient, cfg) -> int:
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs(experiment.experiment_id, f"attributes.run_name = '{cfg.run.name}'") if experiment else []
    return int(runs[0].data.metrics.get("last_step", 0)) if runs else 0
