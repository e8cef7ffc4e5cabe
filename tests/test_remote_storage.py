"""Data and checkpoints on S3: a local S3-compatible server (moto, 127.0.0.1) stands in for the cloud.

The one stand-in in the suite: an object store cannot exist here otherwise. Credentials come only
from the environment (dummy values), as on a real cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient
from moto.server import ThreadedMotoServer

from conftest import REPO, assert_resumed, assert_same_state, checkpoint_state, free_port
from raytrain_ft.core.run_folder import step_path

pytestmark = pytest.mark.exclusive


@pytest.fixture
def s3_env(monkeypatch):
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().makedirs("rtft", exist_ok=True)  # moto's state is per process: test_prepare may have made it
    yield env
    server.stop()


def test_s3_data_and_checkpoints_resume_to_the_local_weights(tmp_path, s3_env, dataset, reference):
    """`python jobs/pretrain.py` with the data and the run on `s3://`: the local `dataset` fixture's
    files uploaded as they are (`prepare` writing to S3: test_prepare.py::test_given_tokenizer_to_s3)."""
    import s3fs

    s3fs.S3FileSystem().put(dataset, "rtft/data/tiny", recursive=True)
    env = {**os.environ, **s3_env}
    common = ["run.name=s3", "train.max_steps=30"]
    job = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "jobs", "pretrain.py"),
            "--config",
            os.path.join(REPO, "configs", "tiny.yaml"),
            *common,
            "data.path=s3://rtft/data/tiny",
            "run.storage_path=s3://rtft/runs",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "faults=[{kind: kill, step: 12, rank: 1}]",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    [mlflow_run] = MlflowClient(uri).search_runs(
        [MlflowClient(uri).get_experiment_by_name("raytrain-ft").experiment_id]
    )
    assert_resumed(uri, mlflow_run.info.run_id, [0, 10])  # restored from s3://, not re-run from 0
    assert_same_state(checkpoint_state(step_path("s3://rtft/runs/s3", 30)), reference[2])  # the local-storage run
    steps = sorted(p.rsplit("/", 1)[-1] for p in s3fs.S3FileSystem().ls("rtft/runs/s3") if "/step-" in p)
    assert steps == ["step-20", "step-25", "step-30"]  # committed on S3, retention (num_to_keep=3) applied there
