"""Recovery history in a real `mlflow server`, the `history` CLI, and hangs turned into restarts (real Ray)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from conftest import (
    assert_kept_timeline,
    assert_resumed,
    assert_same_state,
    events,
    final_state,
    make_config,
    metric_by_step,
    run_root,
)
from raytrain_ft.core.run_folder import RUN_ID_FILE
from raytrain_ft.data.audit import read_audit
from raytrain_ft.launch.driver import RunFailed, run
from raytrain_ft.launch.tracking_server import mlflow_server
from raytrain_ft.resilience.recovery import KILLED, recovery_rows
from raytrain_ft.telemetry.plots import loss_figure
from raytrain_ft.telemetry.tracking import MlflowRecorder

pytestmark = pytest.mark.usefixtures("ray_local")


def run_id_of(cfg) -> str:
    with open(os.path.join(cfg.run.storage_path, cfg.run.name, RUN_ID_FILE)) as f:
        return f.read().strip()


def table(cfg, run_id: str, name: str) -> list[dict]:
    path = MlflowClient(cfg.tracking.uri).download_artifacts(run_id, name)
    with open(path) as f:
        t = json.load(f)
    return [dict(zip(t["columns"], row, strict=True)) for row in t["data"]]


@pytest.fixture(scope="module")
def tracking_server(tmp_path_factory):
    """A real `mlflow server` process on 127.0.0.1: HTTP, SQLite backend, artifact serving."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    with mlflow_server(f"sqlite:///{folder}/mlflow.db", str(folder / "mlartifacts"), "127.0.0.1") as url:
        yield url


@pytest.mark.exclusive
def test_three_failures_make_three_recovery_rows_and_the_history_cli_prints_them(
    tmp_path, dataset, tracking_server, monkeypatch, reference
):
    """A kill, an exception and a hung rank in one run (the hang: rank 1 sleeps inside step 27; the
    driver's progress watchdog records every worker's stacks and stops rank 1, and the group restarts)."""
    faults = (
        "faults=[{kind: kill, step: 12, rank: 1}, {kind: raise, step: 23, rank: 0},"
        " {kind: hang, step: 27, rank: 1, seconds: 600}]"
    )
    cfg = make_config(
        tmp_path,
        dataset,
        "run.name=rec",
        "train.max_steps=30",
        "data.audit=true",
        "failure.hang_timeout_s=10",
        faults,
    )
    cfg.tracking.uri = ""  # MLflow's own variable names the server, for the job and the CLI
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_server)
    run_id = run(cfg)
    cfg.tracking.uri = tracking_server  # for the helpers below
    # a kill, an exception and a hang: still bitwise the uninterrupted run, every step on the same sample ids
    ref_cfg, ref_run, ref_state = reference
    assert_resumed(cfg.tracking.uri, run_id, [0, 10, 20, 25])
    assert_same_state(final_state(cfg, 30), ref_state)
    assert read_audit(run_root(cfg)).equals(read_audit(run_root(ref_cfg)))
    assert read_audit(run_root(cfg)).num_rows == 30 * 8  # one row per sequence: 30 global batches of 8
    assert_kept_timeline(cfg, run_id, ref_cfg, ref_run, discarded=[11, 21, 22, 26, 27])
    client = MlflowClient(tracking_server)
    experiment = client.get_experiment_by_name("raytrain-ft")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's training view
    assert len(client.search_runs([experiment.experiment_id])) == 1
    # artifacts went through the server's artifact proxy, not to a local path
    assert client.get_run(run_id).info.artifact_uri.startswith("mlflow-artifacts:/")
    rows = table(cfg, run_id, "recovery_history.json")
    assert [(r["last_step"], r["resumed_from"], r["lost_steps"]) for r in rows] == [
        (11, 10, 1),
        (22, 20, 2),
        (27, 25, 2),
    ]
    assert "rank 1" in rows[0]["cause"] and "InjectedFault" in rows[1]["cause"] and "rank 1" in rows[2]["cause"]
    assert client.get_run(run_id).data.tags["last_failure_cause"] == rows[2]["cause"]  # the hang, root cause first
    assert all(r["downtime_s"] > 0 and r["world_size_before"] == r["world_size_after"] == 2 for r in rows)
    # each recovery's phases in the order they happen (seconds after the failure was detected)
    assert all(0 < r["group_ready_s"] <= r["restored_s"] <= r["first_batch_s"] <= r["downtime_s"] for r in rows)
    metrics = client.get_run(run_id).data.metrics
    assert metrics["restarts"] == 3 and metrics["lost_steps_total"] == 5
    assert metrics["downtime_s_total"] == pytest.approx(sum(r["downtime_s"] for r in rows))

    # goodput: every second of the wall time in one bucket; restarts cost time
    with open(client.download_artifacts(run_id, "goodput_summary.json")) as f:
        goodput = json.load(f)
    badput = {k[len("badput_") : -len("_s")]: v for k, v in goodput.items() if k.startswith("badput_")}
    assert 0 < goodput["goodput"] < 1 and goodput["goodput"] == pytest.approx(
        goodput["productive_s"] / goodput["wall_s"]
    )
    assert goodput["productive_s"] + sum(badput.values()) == pytest.approx(goodput["wall_s"], rel=0.05)
    assert all(badput[k] > 0 for k in ("checkpoint_stall", "lost_work", "restart_downtime", "restore", "startup"))
    assert badput["skipped_steps"] == 0 and badput["hang"] > 0  # the time without a step is hang time
    # the ledger is in the checkpoint: each resumed attempt starts from the productive seconds its
    # checkpoint held (attempt-start values at steps 10 and 20), never from an empty account
    productive = metric_by_step(cfg, run_id, "productive_s")
    assert 0 < productive[10] < productive[20] <= goodput["productive_s"]
    # event order, not durations: each failure's attempt start comes before its first resumed step
    assert badput["restart_downtime"] + badput["restore"] < metrics["downtime_s_total"]
    assert metrics["goodput"] == goodput["goodput"]

    # the hung rank, named by the driver's progress watchdog: every worker's stacks (py-spy) in MLflow
    # and the run folder say where it was stuck
    [hang] = events(cfg.tracking.uri, run_id, "hang")
    assert (hang["ranks"], hang["step"]) == ([1], 26)  # rank 0 finished step 27 and waits in step 28
    with open(client.download_artifacts(run_id, hang["stack_dump"])) as f:
        dump = f.read()
    assert dump.startswith("progress watchdog: rank 1 did not arrive after step 26: no progress for 1")
    assert "Process " in dump.split("--- rank 1 ")[1] and "--- rank 0 " in dump  # py-spy's dump of every rank
    assert os.listdir(os.path.join(cfg.run.storage_path, cfg.run.name, "hangs"))[0].startswith("step26-")
    assert hang["stalled_s"] >= 10  # the watchdog's own measure: at least its bound

    # the loss plot marks every failure at its last completed step
    assert "loss.png" in {a.path for a in client.list_artifacts(run_id)}
    kept, discarded = (
        [(m.step, m.value) for m in client.get_metric_history(run_id, k)]
        for k in ("train/loss", "train_discarded/loss")
    )
    fig = loss_figure(kept, discarded, MlflowRecorder(cfg.tracking.uri, run_id).events())
    assert sorted(line.get_xdata()[0] for line in fig.axes[0].lines if line.get_gid() == "failure") == [11, 22, 27]
    grey = next(c for c in fig.axes[0].collections if c.get_gid() == "discarded")  # the re-run steps' first values
    assert sorted(x for x, _ in grey.get_offsets()) == [11, 21, 22, 26, 27]

    cli = subprocess.run(
        [sys.executable, "-m", "raytrain_ft.cli", "history", "rec"],  # the URI from MLFLOW_TRACKING_URI
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert "Downloading artifacts" not in cli.stdout + cli.stderr  # no progress bar above the table
    assert "Recovery history" in cli.stdout and "InjectedFault" in cli.stdout
    assert "restarts 3, lost_steps_total 5" in cli.stdout
    assert f"goodput {goodput['goodput']:.3f}" in cli.stdout
    assert re.search(rf"restart_downtime\s*│\s*{badput['restart_downtime']:.1f}\s", cli.stdout)


def test_a_run_out_of_restarts_ends_with_one_line_naming_rank_step_and_cause(tmp_path, dataset):
    faults = "faults=[{kind: kill, step: 7, rank: 1}, {kind: kill, step: 9, rank: 1}]"
    cfg = make_config(tmp_path, dataset, "run.name=out", "train.max_steps=12", "failure.max_failures=1", faults)
    with pytest.raises(RunFailed) as e:
        run(cfg)
    line = str(e.value)  # jobs/pretrain.py prints it as its last line: "error: <line>"
    assert "\n" not in line and len(line) < 300, line
    assert line.startswith("run out failed after 1/1 restarts: rank 1 after step 8: killed (SIGKILL, OOM killer")
    assert line.endswith(f"; details: raytrain-ft history out --tracking-uri {cfg.tracking.uri}")
    # the recovery history says the same, root cause first; Ray's paragraph stays in the event file
    events = MlflowRecorder(cfg.tracking.uri, run_id_of(cfg)).events()
    rows = recovery_rows(events)
    assert [(r["last_step"], r["resumed_from"]) for r in rows] == [(6, 5), (8, None)]
    assert MlflowClient(cfg.tracking.uri).get_run(run_id_of(cfg)).info.status == "FAILED"
    assert [r["cause"].split("; ")[0] for r in rows] == ["rank 1: " + KILLED] * 2
    failure = next(ev for ev in events if ev["kind"] == "failure")
    assert "worker process has died" in failure["details"]["1"]
