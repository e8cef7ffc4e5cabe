"""`raytrain-ft history` and `raytrain-ft runs`: a run's recovery history and goodput, a store's
runs, as rich tables or JSON (the reports themselves: `raytrain_ft.telemetry.reports`)."""

from __future__ import annotations

import argparse
import json
import typing

from raytrain_ft.cli.common import RUN_HELP, add_tracking_uri, mlflow_run
from raytrain_ft.telemetry.reports import history_report, run_rows

if typing.TYPE_CHECKING:
    pass


def _history(args: argparse.Namespace) -> int:
    """Print a run's recovery history, guard events, totals and goodput from MLflow (see
    `raytrain_ft.resilience.recovery`); `--json`: `history_report`'s object instead."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    client, run = mlflow_run(args.run, args.tracking_uri)
    report = history_report(client, run)
    if args.json:
        print(json.dumps(report, default=str))
        return 0
    console = Console(width=200)
    console.print(f"run {run.info.run_name} ({run.info.run_id}), status {run.info.status}")
    for title, rows in report["tables"].items():
        table = Table(title=title)
        rows = [_with_tier(r) for r in rows]
        keys = list(rows[0]) if rows else ["(none)"]
        for key in keys:
            table.add_column(key)
        for row in rows:
            table.add_row(*(escape(str(row[k])) for k in keys))  # causes contain "[...]"
        console.print(table)
    console.print(", ".join(f"{k} {v:g}" for k, v in report["totals"].items()))
    console.print(_goodput_table(run.data.metrics))
    return 0


def _with_tier(row: dict) -> dict:
    """A recovery row for the terminal: the tier beside the step it resumed from ("18 memory"), its
    restore's seconds left to `--json` (the table stays readable at 200 columns)."""
    if "restore_s" not in row:  # not a restart's row (a replacement's `restored_from` is its checkpoint's step)
        return row
    shown = {k: v for k, v in row.items() if k not in ("restored_from", "restore_s")}
    if row["resumed_from"] is not None and row["restored_from"]:
        shown["resumed_from"] = f"{row['resumed_from']} {row['restored_from']}"
    return shown


def _goodput_table(metrics: dict[str, float]):
    """The latest goodput summary (`raytrain_ft.telemetry.goodput`): productive time and each badput part."""
    from rich.table import Table

    from raytrain_ft.telemetry.goodput import PARTS

    if "goodput" not in metrics:
        return "goodput: none logged yet"
    table = Table(title="Goodput", caption=f"goodput {metrics['goodput']:.3f}")
    for column in ("part", "seconds", "% of wall time"):
        table.add_column(column, justify="left" if column == "part" else "right")
    wall = metrics["wall_s"]
    for part, key in [("productive", "productive_s")] + [(p, f"badput_{p}_s") for p in PARTS]:
        table.add_row(part, f"{metrics.get(key, 0.0):.1f}", f"{100 * metrics.get(key, 0.0) / wall:.1f}")
    table.add_row("wall time", f"{wall:.1f}", "100.0")
    return table


def _add_history(subparsers) -> None:
    p = subparsers.add_parser("history", help="a run's recovery history, guard events and goodput, from MLflow")
    p.add_argument("run", help=RUN_HELP)
    add_tracking_uri(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (tables, totals, goodput, events)")
    p.set_defaults(func=_history)


def _runs(args: argparse.Namespace) -> int:
    """List the training runs of a tracking store, newest first (`run_rows`)."""
    from rich.console import Console
    from rich.table import Table

    from raytrain_ft.telemetry.run_resolver import store

    client = store(args.tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    rows = run_rows(client.search_runs(experiments, order_by=["attributes.start_time DESC"]) if experiments else [])
    if args.json:
        print(json.dumps({"tracking_uri": client.tracking_uri, "runs": rows}))
        return 0
    table = Table(title=f"Runs in {client.tracking_uri}")
    for column in ("name", "status", "step", "loss", "val_loss", "restarts", "goodput"):
        table.add_column(column, justify="left" if column in ("name", "status") else "right")
    for row in rows:
        table.add_row(*row.values())
    Console(width=160).print(table)
    return 0


def _add_runs(subparsers) -> None:
    p = subparsers.add_parser("runs", help="the runs of an MLflow store: status, progress, loss, restarts, goodput")
    add_tracking_uri(p)
    p.add_argument("--json", action="store_true", help="print one JSON object: {tracking_uri, runs: [rows]}")
    p.set_defaults(func=_runs)


def add_parsers(subparsers) -> None:
    """Add this module's commands to `subparsers`."""
    _add_history(subparsers)
    _add_runs(subparsers)
