"""The default MLflow store: one place for the driver, however it was started, and `raytrain-ft history`.

No Ray: `tracking_store` is asked for a single-node head (`_shared_cluster` False); the multi-node
case, where the driver serves the same file through `mlflow server`, is
`test_tracking.py::test_without_a_uri_every_node_reaches_the_tracking_server`.
"""

from __future__ import annotations

import os

from raytrain_ft.cli import main
from raytrain_ft.launch import tracking_server
from raytrain_ft.telemetry.tracking import resolve_uri, start_or_resume_run
from raytrain_ft.training.preflight import check_tracking


def test_history_without_flags_finds_a_run_whose_driver_ran_in_rays_working_dir_copy(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking_server, "_shared_cluster", lambda: False)
    # where `ray job submit --working-dir .` runs the driver: a copy Ray deletes after the job
    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_abc"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    check_tracking(resolve_uri(""))  # preflight passes before the default store's folder exists
    with tracking_server.tracking_store("") as uri:
        start_or_resume_run(uri, "raytrain-ft", str(tmp_path / "runs" / "llama"), "llama", {})
    assert uri == f"sqlite:///{home}/raytrain-ft/mlflow.db"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # where a user types the command, on the same machine
    assert main(["history", "llama"]) == 0
    assert capsys.readouterr().out.startswith("run llama (")
    assert not os.path.exists(elsewhere / "mlflow.db")


def test_the_uri_is_the_config_then_mlflow_tracking_uri_then_sqlite_in_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir("/")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_uri("") == f"sqlite:///{tmp_path}/raytrain-ft/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://10.0.0.5:5000")
    assert resolve_uri("") == "http://10.0.0.5:5000"
    assert resolve_uri("sqlite:////x/m.db") == "sqlite:////x/m.db"


def test_history_never_creates_a_store(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["history", "demo"]) == 2
    store = f"sqlite:///{tmp_path}/raytrain-ft/mlflow.db"
    assert capsys.readouterr().err.startswith(f"error: no MLflow store at {store}; point")
    assert not os.path.exists(tmp_path / "raytrain-ft")
