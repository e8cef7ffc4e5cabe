"""The job entry points as users run them: subprocesses, `ray start --head` + `ray job submit`, resubmission."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from mlflow.tracking import MlflowClient

from conftest import COMMITTED, REPO, assert_resumed, events, make_config, sqlite_store
from raytrain_ft.errors import ConfigError
from raytrain_ft.launch.driver import preflight

PRETRAIN = os.path.join(REPO, "jobs", "pretrain.py")
TINY = os.path.join(REPO, "configs", "tiny.yaml")
BIN = os.path.dirname(sys.executable)
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}:{os.environ['PATH']}"}


def run_args(tmp_path, dataset, *extra):
    return [
        f"data.path={dataset}",
        f"run.storage_path={tmp_path / 'runs'}",
        f"tracking.uri={sqlite_store(tmp_path)}",
        *extra,
    ]


def pretrain(*args, timeout=300):
    return subprocess.run(
        [sys.executable, PRETRAIN, "--config", TINY, *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_unknown_config_key_is_one_line_error(tmp_path, dataset):
    r = pretrain(*run_args(tmp_path, dataset, "train.max_stepz=3"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: unknown config key 'train.max_stepz'; did you mean 'train.max_steps'?"
    ]


def test_missing_dataset_is_one_line_error(tmp_path, dataset):
    r = pretrain(*run_args(tmp_path, tmp_path / "nowhere"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: no prepared dataset at {tmp_path / 'nowhere'} (manifest.json missing); run "
        f"`python jobs/prepare_data.py --output {tmp_path / 'nowhere'}` or set data.path"
    )


def test_a_gpu_run_on_a_cluster_without_gpus_names_use_gpu(tmp_path, dataset, ray_local):
    cfg = make_config(tmp_path, dataset, "scaling.use_gpu=true")
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert str(e.value) == (
        "scaling.num_workers=2 needs 2 GPU but the Ray cluster has 0; "
        "lower scaling.num_workers or set scaling.use_gpu=false, or add GPU nodes"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_session(sid: int) -> None:
    """SIGKILL every process of a session (a job and the Ray instance it started), nothing else:
    `ray stop` would also stop the Ray instance of this test process."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_ray_job_submit_to_a_started_head(tmp_path, dataset):
    gcs, dashboard, agent, agent_grpc, metrics = (free_port() for _ in range(5))
    head = subprocess.Popen(
        [
            os.path.join(BIN, "ray"),
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            "--num-cpus=2",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--dashboard-agent-listen-port={agent}",  # the test session's own Ray holds the default ports
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            "--disable-usage-stats",
        ],
        env=ENV,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        for _ in range(90):
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                break
            except OSError:
                time.sleep(1)
        submit = [os.path.join(BIN, "ray"), "job", "submit", "--address", address, "--", "python", PRETRAIN]
        submit += ["--config", TINY, *run_args(tmp_path, dataset, "run.name=submitted", "train.max_steps=6")]
        for _ in range(30):  # the dashboard answers before its job agent is up: Ray says "try again later"
            r = subprocess.run(submit, capture_output=True, text=True, timeout=400, env=ENV)
            if "No available agent to submit job" not in r.stdout + r.stderr:
                break
            time.sleep(2)
    finally:
        kill_session(head.pid)
        head.wait()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "run submitted finished" in r.stdout and "succeeded" in r.stdout
    assert os.path.exists(tmp_path / "runs" / "submitted" / "step-6" / ".metadata")


def test_a_stopped_run_is_killed_in_mlflow_and_a_resubmission_finishes_it(tmp_path, dataset):
    args = run_args(tmp_path, dataset, "run.name=resub", "train.max_steps=20", "checkpoint.interval_steps=5")
    args.append("faults=[{kind: slow, step: 11, steps: 10, seconds: 0.5, rank: -1}]")  # SIGTERM comes mid-run
    proc = subprocess.Popen(
        [sys.executable, PRETRAIN, "--config", TINY, *args],
        env=ENV,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    snapshot = tmp_path / "runs" / "resub" / "checkpoint_manager_snapshot.json"
    deadline = time.time() + 240
    while time.time() < deadline and not (snapshot.exists() and '"step-10"' in snapshot.read_text()):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # what `ray job stop` and a preempted head send the driver
    stderr = proc.communicate(timeout=120)[1]
    kill_session(proc.pid)  # anything of the job's local Ray instance left behind
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("run resub stopped by SIGTERM; its MLflow run is KILLED")
    assert '"step-10"' in snapshot.read_text()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [stopped] = client.search_runs([client.get_experiment_by_name("raytrain-ft").experiment_id])
    assert stopped.info.status == "KILLED" and stopped.info.end_time is not None

    r = pretrain(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = client.search_runs([client.get_experiment_by_name("raytrain-ft").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    # the resubmission resumed from a commit at or after step 10 (when the driver stopped is timing)
    _, resubmitted = assert_resumed(f"sqlite:///{tmp_path / 'mlflow.db'}", runs[0].info.run_id, [0, COMMITTED])
    assert resubmitted["resumed_from"] >= 10
    assert runs[0].info.run_id == stopped.info.run_id
    # one value per step, the stopped attempt's unpublished ones included (recovered from train_live/loss)
    assert sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")) == list(range(1, 21))


def committed_steps(snapshot) -> list[int]:
    """Steps of the checkpoints Ray Train registered (its `checkpoint_manager_snapshot.json`)."""
    return sorted({int(s) for s in re.findall(r'"step-(\d+)"', snapshot.read_text())})


def test_resubmission_after_the_driver_died_resumes_the_same_run(tmp_path, dataset):
    """SIGKILL of the whole job (driver, its Ray instance, the workers, the MLflow client): nothing
    can clean up or record anything. The same command again resumes from the last checkpoint Ray
    had registered, into the same MLflow run, and finishes it."""
    args = run_args(tmp_path, dataset, "run.name=killed", "train.max_steps=20", "checkpoint.interval_steps=5")
    args.append("faults=[{kind: slow, step: 11, steps: 10, seconds: 0.5, rank: -1}]")  # the kill comes mid-run
    proc = subprocess.Popen(
        [sys.executable, PRETRAIN, "--config", TINY, *args],
        env=ENV,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    snapshot = tmp_path / "runs" / "killed" / "checkpoint_manager_snapshot.json"
    deadline = time.time() + 240
    while time.time() < deadline and not (snapshot.exists() and 10 in committed_steps(snapshot)):
        time.sleep(0.5)
    kill_session(proc.pid)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    committed = max(committed_steps(snapshot))
    assert 10 <= committed < 20
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [killed] = client.search_runs([client.get_experiment_by_name("raytrain-ft").experiment_id])
    assert killed.info.status == "RUNNING"  # nobody was left to end it

    r = pretrain(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = client.search_runs([client.get_experiment_by_name("raytrain-ft").experiment_id])
    assert [run.info.run_id for run in runs] == [killed.info.run_id] and runs[0].info.status == "FINISHED"
    # Ray's snapshot is the record of what committed: the values the killed tracking actor still held
    # (the commit's goodput metrics among them) died with it, so `assert_resumed` has no MLflow evidence
    attempts = events(f"sqlite:///{tmp_path / 'mlflow.db'}", killed.info.run_id, "attempt_start")
    assert [a["resumed_from"] for a in attempts] == [0, committed]
    assert os.path.exists(tmp_path / "runs" / "killed" / "step-20" / ".metadata")
