"""`raytrain-ft history RUN --json` and `runs --json` against a real SQLite MLflow store (no Ray):
one JSON object with what the tables show, and the run's events."""

from __future__ import annotations

import json

from mlflow.tracking import MlflowClient

from raytrain_ft.cli import main
from raytrain_ft.telemetry.tracking import MlflowRecorder, start_or_resume_run


def test_history_and_runs_print_one_json_object_with_the_rows_and_the_events(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = start_or_resume_run(uri, "raytrain-ft", str(tmp_path / "runs" / "demo"), "demo", {"train.max_steps": 20})
    recorder = MlflowRecorder(uri, run_id)
    recorder.event("attempt_start", resumed_from=0, world_size=3)
    recorder.event("straggler", step=17, rank=1, node="n1", factor=2.01, first_step=11, action="warn")
    MlflowClient(uri).log_metric(run_id, "goodput", 0.9, step=0)
    assert recorder.drain(30.0)  # events are sent in the background: the store has them before the CLI reads

    assert main(["history", "demo", "--json", "--tracking-uri", uri]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run"] == {"name": "demo", "id": run_id, "status": "RUNNING"}
    assert [(e["kind"], e["step"]) for e in report["events"]] == [("attempt_start", None), ("straggler", 17)]
    straggler = report["events"][1]
    assert {k: straggler[k] for k in ("rank", "node", "factor", "first_step", "action")} == {
        "rank": 1,
        "node": "n1",
        "factor": 2.01,
        "first_step": 11,
        "action": "warn",
    }
    assert isinstance(straggler["time"], float)
    [guard_row] = report["tables"]["Guard events"]  # the table row the text output shows
    assert (guard_row["kind"], guard_row["step"]) == ("straggler", 17) and "rank=1" in guard_row["detail"]
    assert report["tables"]["Recovery history"] == [] and report["totals"]["restarts"] == 0.0
    assert report["goodput"] == {"goodput": 0.9}

    assert main(["runs", "--json", "--tracking-uri", uri]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"], r["step"], r["goodput"]) for r in runs["runs"]] == [
        ("demo", "RUNNING", "0/20", "0.900")
    ]
