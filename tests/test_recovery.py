"""Recovery history in MLflow, the `history` CLI, and hangs turned into restarts (real Ray, 2 workers)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from conftest import make_config, metric_by_step
from raytrain_ft.launch.trainer import run
from raytrain_ft.loss_plot import loss_figure
from raytrain_ft.tracking import RunLogger

pytestmark = pytest.mark.usefixtures("ray_local")


def table(cfg, run_id: str, name: str) -> list[dict]:
    path = MlflowClient(cfg.tracking.uri).download_artifacts(run_id, name)
    with open(path) as f:
        t = json.load(f)
    return [dict(zip(t["columns"], row, strict=True)) for row in t["data"]]


def test_two_failures_make_two_recovery_rows_and_the_history_cli_prints_them(tmp_path, dataset):
    faults = "faults=[{kind: kill, step: 12, rank: 1}, {kind: raise, step: 23, rank: 0}]"
    cfg = make_config(tmp_path, dataset, "run.name=rec", "train.max_steps=30", faults)
    run_id = run(cfg)
    client = MlflowClient(cfg.tracking.uri)
    assert len(client.search_runs([client.get_experiment_by_name("raytrain-ft").experiment_id])) == 1
    rows = table(cfg, run_id, "recovery_history.json")
    assert [(r["last_step"], r["resumed_from"], r["lost_steps"]) for r in rows] == [(11, 10, 1), (22, 20, 2)]
    assert "rank 1" in rows[0]["cause"] and "InjectedFault" in rows[1]["cause"]
    assert all(r["downtime_s"] > 0 and r["world_size_before"] == r["world_size_after"] == 2 for r in rows)
    metrics = client.get_run(run_id).data.metrics
    assert metrics["restarts"] == 2 and metrics["lost_steps_total"] == 3
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
    assert badput["skipped_steps"] == badput["hang"] == 0
    # the ledger is in the checkpoint: each resumed attempt starts from the productive seconds its
    # checkpoint held (attempt-start values at steps 10 and 20), never from an empty account
    productive = metric_by_step(cfg, run_id, "productive_s")
    assert 0 < productive[10] < productive[20] <= goodput["productive_s"]
    # event order, not durations: each failure's attempt start comes before its first resumed step
    assert badput["restart_downtime"] + badput["restore"] < metrics["downtime_s_total"]
    assert metrics["goodput"] == goodput["goodput"]

    # the loss plot marks both failures at their last completed step
    assert "loss.png" in {a.path for a in client.list_artifacts(run_id)}
    kept, discarded = (
        [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in ("loss", "discarded/loss")
    )
    fig = loss_figure(kept, discarded, RunLogger(cfg.tracking.uri, run_id).events())
    assert sorted(line.get_xdata()[0] for line in fig.axes[0].lines if line.get_gid() == "failure") == [11, 22]
    grey = next(c for c in fig.axes[0].collections if c.get_gid() == "discarded")  # the re-run steps' first values
    assert sorted(x for x, _ in grey.get_offsets()) == [11, 21, 22]

    cli = subprocess.run(
        [sys.executable, "-m", "raytrain_ft.cli", "history", "rec", "--tracking-uri", cfg.tracking.uri],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert "Recovery history" in cli.stdout and "InjectedFault" in cli.stdout
    assert "restarts 2, lost_steps_total 3" in cli.stdout
    assert f"goodput {goodput['goodput']:.3f}" in cli.stdout
    assert re.search(rf"restart_downtime\s*│\s*{badput['restart_downtime']:.1f}\s", cli.stdout)


def test_a_hung_rank_dumps_its_stacks_and_the_group_restarts(tmp_path, dataset):
    faults = "faults=[{kind: hang, step: 8, rank: 1, seconds: 600}]"
    cfg = make_config(tmp_path, dataset, "train.max_steps=15", "failure.hang_timeout_s=20", faults)
    run_id = run(cfg)
    hangs = [e for e in RunLogger(cfg.tracking.uri, run_id).events() if e["kind"] == "hang"]
    # rank 1 sleeps inside its step; rank 0, blocked in the next all-reduce, may time out too
    hung = {h["rank"]: h for h in hangs}
    assert 1 in hung and set(hung) <= {0, 1}
    with open(MlflowClient(cfg.tracking.uri).download_artifacts(run_id, hung[1]["stack_dump"])) as f:
        dump = f.read()
    assert "no step completed for 20 s" in dump and "in after_optimizer_step" in dump  # where rank 1 was stuck
    dumps = os.listdir(os.path.join(cfg.run.storage_path, cfg.run.name, "hangs"))
    assert "rank1" in {d.split("-")[0] for d in dumps}
    rows = table(cfg, run_id, "recovery_history.json")
    assert [r["resumed_from"] for r in rows] == [5]
    # goodput: the time without a step is hang time, not lost work (the watchdog's own measure of
    # it is at least its timeout; the ledger's bucket holds it; no upper bound: timing is for benchmarks)
    assert hung[1]["stalled_s"] >= 20
    assert MlflowClient(cfg.tracking.uri).get_run(run_id).data.metrics["badput_hang_s"] > 0
    assert MlflowClient(cfg.tracking.uri).get_run(run_id).info.status == "FINISHED"
