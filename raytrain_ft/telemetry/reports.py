"""The reports the command line prints, as JSON-ready objects built from an MLflow store: a run's
recovery history, guard events and goodput (`history_report`), a store's runs (`run_rows`)."""

from __future__ import annotations


def history_report(client, run) -> dict:
    """What `raytrain-ft history` shows, as one JSON-ready object: `run` (name, id, status), `tables`
    ({title: rows}, each row a dict of the table's columns), `totals`, `goodput` (the latest goodput
    metrics, seconds and fractions; empty before any) and `events` (every event of the run, oldest
    first, each `{"kind", "step", "time", ...its fields}`; `step` None for events of no step, `time`
    unix seconds)."""
    from raytrain_ft.resilience import recovery
    from raytrain_ft.telemetry.tracking import MlflowRecorder, steps_logged_since

    events = MlflowRecorder(client.tracking_uri, run.info.run_id).events()
    tables = {"Recovery history": recovery.recovery_rows(events)}
    if any(e["kind"] == "failure" and e.get("replaced") for e in events):  # replica recovery replaced some
        done = steps_logged_since(client, run.info.run_id, 0.0)
        tables["Replica replacements"] = recovery.replacement_rows(events, done)
    tables["Preemptions"] = recovery.preemption_rows(events)
    tables["Guard events"] = recovery.guard_rows(events)
    metrics = run.data.metrics
    goodput_keys = ("goodput", "wall_s", "productive_s")
    return {
        "run": {"name": run.info.run_name, "id": run.info.run_id, "status": run.info.status},
        "tables": tables,
        "totals": recovery.totals(tables["Recovery history"]),
        "goodput": {k: v for k, v in metrics.items() if k in goodput_keys or k.startswith("badput_")},
        "events": [{"kind": e["kind"], "step": e.get("step"), "time": e["time"], **e} for e in events],
    }


def run_rows(runs) -> list[dict[str, str]]:
    """One row per MLflow run (`mlflow.entities.Run`): name, status, step / max_steps (the extended
    target where `raytrain-ft extend` set the `max_steps` tag), last loss and val_loss, restarts and
    goodput (blank where not logged yet)."""
    from raytrain_ft.telemetry.timeline import KEPT

    def number(metrics: dict, key: str, fmt: str) -> str:
        return format(metrics[key], fmt) if key in metrics else ""

    rows = []
    for r in runs:
        m, max_steps = r.data.metrics, r.data.tags.get("max_steps", r.data.params.get("train.max_steps", "?"))
        rows.append(
            {
                "name": r.info.run_name,
                "status": r.info.status,
                "step": f"{int(m.get('last_step', 0))}/{max_steps}",
                "loss": number(m, KEPT + "loss", ".4f"),
                "val_loss": number(m, KEPT + "val_loss", ".4f"),
                "restarts": str(int(m.get("restarts", 0))),
                "goodput": number(m, "goodput", ".3f"),
            }
        )
    return rows
