"""What the commands share: how a RUN argument is helped and found, and the `--tracking-uri` flag."""

from __future__ import annotations

import argparse

RUN_HELP = (
    "a run folder (run.storage_path/run.name), an MLflow run id, or a run name (raytrain_ft.telemetry.run_resolver)"
)


def add_tracking_uri(p: argparse.ArgumentParser) -> None:
    """`--tracking-uri`: the MLflow store a RUN is looked up in (`raytrain_ft.telemetry.run_resolver`)."""
    p.add_argument(
        "--tracking-uri",
        default="",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///$HOME/raytrain-ft/mlflow.db, "
        "where a run without tracking.uri logs)",
    )


def mlflow_run(run: str, tracking_uri: str):
    """(the store's `MlflowClient`, the MLflow `Run` of RUN): `run_resolver.find_run`'s rules."""
    from raytrain_ft.telemetry.run_resolver import find_run, store

    found = find_run(run, tracking_uri)
    return store(found.tracking_uri or tracking_uri), found.mlflow_run(tracking_uri)
