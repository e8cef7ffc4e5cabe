"""The `raytrain-ft` command line. One subcommand per task; add one with a `_add_<name>` function below.

    raytrain-ft plan-interval --mtbf-hours 10000 --gpus 1000 --checkpoint-seconds 300
    raytrain-ft plan-goodput --gpus 1000 --mtbf-hours 10000 [--from-run RUN] [--json] [--plot FILE]
    raytrain-ft plan-memory --config configs/gpu-7b.yaml [--strategy ddp --micro-batch-size 2 ...]
    raytrain-ft history RUN [--tracking-uri URI] [--json]   (or MLFLOW_TRACKING_URI)
    raytrain-ft check --config configs/gpu-7b.yaml [key=value ...] [--address RAY_ADDRESS]
    raytrain-ft extend RUN --max-steps N [--tracking-uri ...]
    raytrain-ft runs [--tracking-uri ...] [--json]
    raytrain-ft export RUN [--step N] --out DIR [--data PATH] [--register NAME]
    raytrain-ft verify RUN [--step N] [--tracking-uri ...]

RUN is a run folder, an MLflow run id or a run name, found the same way by every command
(`raytrain_ft.telemetry.run_resolver.find_run`). Errors in the input print one `error: ...` line on
stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
from collections.abc import Sequence
from dataclasses import asdict

from raytrain_ft.checkpoint import interval

if typing.TYPE_CHECKING:
    from raytrain_ft.core.config import Config

RUN_HELP = (
    "a run folder (run.storage_path/run.name), an MLflow run id, or a run name (raytrain_ft.telemetry.run_resolver)"
)


def _add_tracking_uri(p: argparse.ArgumentParser) -> None:
    """`--tracking-uri`: the MLflow store a RUN is looked up in (`raytrain_ft.telemetry.run_resolver`)."""
    p.add_argument(
        "--tracking-uri",
        default="",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///$HOME/raytrain-ft/mlflow.db, "
        "where a run without tracking.uri logs)",
    )


def _plan_interval(args: argparse.Namespace) -> int:
    """Young's and Daly's checkpoint intervals and the expected waste for a cluster
    (see `raytrain_ft.checkpoint.interval`)."""
    from rich.console import Console
    from rich.table import Table

    positive = {
        "--mtbf-hours": args.mtbf_hours,
        "--gpus": args.gpus,
        "--checkpoint-seconds": args.checkpoint_seconds,
    }
    if args.step_seconds is not None:
        positive["--step-seconds"] = args.step_seconds
    for flag, value in positive.items():
        if not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if not args.restart_seconds >= 0:
        raise ValueError(f"--restart-seconds must not be negative, got {args.restart_seconds}")

    mtbf_s = interval.cluster_mtbf_s(args.mtbf_hours, args.gpus)
    young_s = interval.young_interval_s(args.checkpoint_seconds, mtbf_s)
    daly_s = interval.daly_interval_s(args.checkpoint_seconds, mtbf_s)
    waste = interval.expected_waste_fraction(daly_s, args.checkpoint_seconds, mtbf_s, args.restart_seconds)

    table = Table(title="Checkpoint interval")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_row("cluster MTBF", f"{mtbf_s / 3600:.1f}", "hours")
    table.add_row("checkpoint cost", f"{args.checkpoint_seconds:g}", "seconds")
    table.add_row("restart time", f"{args.restart_seconds:g}", "seconds")
    table.add_row("Young interval sqrt(2 C M)", f"{young_s / 60:.1f}", "minutes")
    table.add_row("Daly interval (recommended)", f"{daly_s / 60:.1f}", "minutes")
    if args.step_seconds is not None:
        steps = interval.interval_steps(daly_s, args.step_seconds)
        table.add_row("checkpoint.interval_steps (Daly)", str(steps), "steps")
    table.add_row("expected waste at Daly interval", f"{100 * waste:.1f}", "% of wall time")
    Console().print(table)
    return 0


def _add_plan_interval(subparsers) -> None:
    p = subparsers.add_parser(
        "plan-interval",
        help="checkpoint interval from MTBF and checkpoint cost (Young 1974, Daly 2006)",
        description="Optimal checkpoint interval (compute time between checkpoints) for a cluster whose GPUs "
        "fail independently: Young's sqrt(2 C M) and Daly's higher-order estimate, and the first-order "
        "expected fraction of wall time lost at Daly's interval.",
    )
    p.add_argument("--mtbf-hours", type=float, required=True, help="mean time between failures of one GPU, hours")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs in the job")
    p.add_argument("--checkpoint-seconds", type=float, required=True, help="time one checkpoint costs, seconds")
    p.add_argument("--restart-seconds", type=float, default=0.0, help="time to restart after a failure, seconds")
    p.add_argument("--step-seconds", type=float, default=None, help="seconds per training step: also print steps")
    p.set_defaults(func=_plan_interval)


# plan-goodput cost flag (argparse dest) -> `planner.Costs` field
COST_FLAGS = {
    "checkpoint_seconds": "checkpoint_s",
    "save_seconds": "save_s",
    "restart_seconds": "restart_s",
    "replica_rejoin_seconds": "rejoin_s",
    "replica_pause_seconds": "pause_s",
    "step_seconds": "step_s",
    "memory_checkpoint_seconds": "memory_checkpoint_s",
    "memory_save_seconds": "memory_save_s",
}


def _plan_goodput(args: argparse.Namespace) -> int:
    """A month's goodput by recovery mode and checkpoint interval (see `raytrain_ft.resilience.planner`)."""
    import json

    from raytrain_ft.resilience import planner

    given = {field: getattr(args, dest) for dest, field in COST_FLAGS.items() if getattr(args, dest) is not None}
    measured: dict[str, float] = {}
    if args.from_run:
        measured = _measured_costs(args.from_run, args.tracking_uri)
    chosen = {**measured, **given}  # flags win over the run's measurements
    if not chosen.get("memory_checkpoint_s") and "memory_save_s" not in given:
        chosen.pop("memory_save_s", None)  # no memory stall: the memory tier is off, whatever the run logged
    defaults = asdict(planner.DEFAULT_COSTS)
    defaults["save_s"] = chosen.get("checkpoint_s", defaults["save_s"])  # no save time: it commits when its stall ends
    defaults["memory_save_s"] = chosen.get("memory_checkpoint_s", 0.0)  # the same for a memory save
    costs = planner.Costs(**{**defaults, **chosen})
    cluster = planner.Cluster(args.gpus, args.mtbf_hours, args.days, args.gpus_per_replica, args.clustered_fraction)
    modes = planner.MODES if args.mode == "both" else (args.mode,)
    result = planner.plan(cluster, costs, modes, args.interval_seconds, args.repetitions, args.seed)
    if args.plot:
        from raytrain_ft.telemetry.goodput_plot import goodput_figure

        goodput_figure(cluster, costs, min(args.repetitions, 40), args.seed).savefig(args.plot, dpi=120)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print_goodput(result, cluster, costs, {f: "run" for f in measured} | {f: "flag" for f in given}, args.plot)
    return 0


def _measured_costs(run_name: str, tracking_uri: str) -> dict[str, float]:
    """The costs a finished run measured (`planner.measured_costs`), from its MLflow store."""
    from raytrain_ft.resilience.planner_costs import MEAN_METRICS, measured_costs
    from raytrain_ft.telemetry.tracking import MlflowRecorder, steps_logged_since

    client, run = _mlflow_run(run_name, tracking_uri)
    keys = ("train/step_time_s", *MEAN_METRICS, "train/checkpoint_stall_s")
    metrics = {k: [m.value for m in client.get_metric_history(run.info.run_id, k)] for k in keys}
    events = MlflowRecorder(client.tracking_uri, run.info.run_id).events()
    found = measured_costs(events, metrics, steps_logged_since(client, run.info.run_id, 0.0))
    if not found:
        raise ValueError(f"run {run_name!r} logged no step times, checkpoints or recoveries to plan with")
    return found


def _print_goodput(result: dict, cluster, costs, source: dict[str, str], plot: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from raytrain_ft.resilience.planner import LOST_PARTS

    console = Console(width=160)
    failures = cluster.wall_s / cluster.mtbf_s
    console.print(
        f"{cluster.gpus:,} GPUs ({cluster.gpus_per_replica} per replica), MTBF {cluster.mtbf_hours:,g} h per GPU: "
        f"cluster MTBF {cluster.mtbf_s / 3600:.2f} h, {failures:,.0f} failures in {cluster.days:g} days"
        + (f", {cluster.clustered:.0%} of them clustered" if cluster.clustered else "")
    )

    def sourced(memory: bool) -> str:
        items = [(k, v) for k, v in asdict(costs).items() if k.startswith("memory_") == memory]
        return ", ".join(f"{k} {v:g} ({source.get(k, 'default')})" for k, v in items)

    console.print("costs (s): " + sourced(False))
    if costs.memory_tier:
        console.print("memory tier costs (s): " + sourced(True))
    console.print(
        f"Young interval sqrt(2 C M) {result['young_s'] / 60:.1f} min, Daly interval {result['daly_s'] / 60:.1f} min"
        + (f"; memory tier: Daly interval {result['memory_daly_s'] / 60:.1f} min" if costs.memory_tier else "")
    )
    memory = ("memory interval (min)",) if costs.memory_tier else ()
    table = Table(title="Goodput (mean over months; 95 % of months in the range), lost time in % of wall time")
    for column in (
        "mode",
        "interval (min)",
        *memory,
        "goodput",
        "95 % range",
        *(p.replace("_", " ") for p in LOST_PARTS),
    ):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, p in result["modes"].items():
        lo, hi = p["goodput_ci95"]
        table.add_row(
            mode,
            f"{p['interval_s'] / 60:.1f}",
            *(f"{p['memory_interval_s'] / 60:.1f}" if "memory_interval_s" in p else "off" for _ in memory),
            f"{p['goodput']:.3f}",
            f"{lo:.3f}-{hi:.3f}",
            *(f"{100 * p['lost'][part]:.2f}" for part in LOST_PARTS),
        )
    console.print(table)
    if plot:
        console.print(f"wrote {plot}")


def _add_plan_goodput(subparsers) -> None:
    p = subparsers.add_parser(
        "plan-goodput",
        help="a month's goodput by recovery mode and checkpoint interval (Monte Carlo, Young 1974, Daly 2006)",
        description="Simulate many months of a job on --gpus GPUs that fail independently (Poisson, --mtbf-hours "
        "each): restart mode loses the work since the last committed checkpoint and a restart per failure, replica "
        "mode the survivors' pause and the failed replica's share until it rejoins; both pay checkpoint stalls. "
        "With --memory-checkpoint-seconds, a memory tier beside the durable checkpoints: restart mode loses the "
        "work since the newest committed checkpoint of either tier; replica mode ignores it, as the config does. "
        "Prints each mode's goodput (its 95 %% range over months) at its best interval (restart: searched, Daly's "
        "with the memory tier; replica: Daly's) and the lost time by part, with Young's and Daly's intervals. Costs: "
        "flags, else those --from-run measured, else the defaults in raytrain_ft.resilience.planner.DEFAULT_COSTS "
        "(docs/planning.md).",
    )
    p.add_argument("--gpus", type=int, default=1000, help="GPUs in the job (default 1000)")
    p.add_argument("--mtbf-hours", type=float, default=10_000.0, help="MTBF of one GPU, hours (default 10000)")
    p.add_argument("--checkpoint-seconds", type=float, default=None, help="training stall of one save, seconds")
    p.add_argument(
        "--save-seconds", type=float, default=None, help="a save's start until committed, seconds (default: the stall)"
    )
    p.add_argument("--restart-seconds", type=float, default=None, help="group restart: failure to state restored")
    p.add_argument(
        "--memory-checkpoint-seconds",
        type=float,
        default=None,
        help="training stall of one memory-tier save, seconds (absent or 0: the memory tier is off)",
    )
    p.add_argument(
        "--memory-save-seconds",
        type=float,
        default=None,
        help="a memory save's start until committed, its peer copy verified, seconds (default: its stall)",
    )
    p.add_argument(
        "--replica-rejoin-seconds", type=float, default=None, help="replica: failure to the replacement's first step"
    )
    p.add_argument(
        "--replica-pause-seconds", type=float, default=None, help="replica: the survivors' wait after a failure"
    )
    p.add_argument("--step-seconds", type=float, default=None, help="seconds per training step")
    p.add_argument("--gpus-per-replica", type=int, default=1, help="replica mode: GPUs per replica (default 1)")
    p.add_argument(
        "--clustered-fraction", type=float, default=0.0, help="share of failures bringing a second within the recovery"
    )
    p.add_argument("--days", type=float, default=30.0, help="wall time simulated, days (default 30)")
    p.add_argument("--mode", choices=["restart", "replica", "both"], default="both")
    p.add_argument(
        "--interval-seconds", type=float, default=None, help="compute between checkpoints (default: the best)"
    )
    p.add_argument(
        "--from-run",
        default=None,
        metavar="RUN",
        help="take the costs a finished run measured (MLflow; " + RUN_HELP + ")",
    )
    _add_tracking_uri(p)
    p.add_argument("--repetitions", type=int, default=200, help="months simulated (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        action="store_true",
        help="print JSON: young_s, daly_s (seconds), modes (lost: fractions of wall time)",
    )
    p.add_argument("--plot", default=None, metavar="FILE", help="also draw goodput against GPU count into FILE (PNG)")
    p.set_defaults(func=_plan_goodput)


def _plan_memory(args: argparse.Namespace) -> int:
    """Per-device memory of a config or of explicit settings, and whether it fits (see `raytrain_ft.model.memory`)."""
    from rich.console import Console
    from rich.table import Table

    from raytrain_ft.core.config import load_config
    from raytrain_ft.core.errors import ConfigError
    from raytrain_ft.model import memory
    from raytrain_ft.model.causal_lm import model_name

    overrides = [
        f"{key}={getattr(args, dest)}" for dest, key in MEMORY_FLAGS.items() if getattr(args, dest) is not None
    ]
    if args.world_size is not None:
        overrides.append(f"scaling.num_workers={args.world_size}")
    if args.vocab_size < 1:
        raise ValueError(f"--vocab-size must be positive, got {args.vocab_size}")
    try:
        cfg = load_config(args.config, ["scaling.use_gpu=true", *overrides])  # the plan is for GPUs
    except ConfigError as e:
        raise ValueError(str(e)) from None
    seq_len = cfg.train.seq_len or args.default_seq_len
    try:
        p = memory.plan_config(cfg, args.vocab_size, seq_len)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    strategy = memory.resolve_strategy(cfg.parallel, True)
    table = Table(
        title=f"Memory per GPU: {model_name(cfg.model)}, {strategy}, {cfg.worker_range[0]} GPUs, seq_len {seq_len}"
    )
    table.add_column("part")
    table.add_column("GiB", justify="right")
    for part in ("params", "grads", "optimizer", "buffers", "activations"):
        table.add_row(part, f"{getattr(p, part) / memory.GIB:.2f}")
    table.add_row("total per GPU", f"{p.device_total / memory.GIB:.2f}")
    table.add_row(
        f"{cfg.scaling.gpu_type} memory ({memory.HEADROOM:.0%} usable)", f"{p.device_memory / memory.GIB:.0f}"
    )
    table.add_row("checkpoint staging (pinned host memory per node)", f"{p.staging_per_node / memory.GIB:.2f}")
    Console(width=120).print(table)
    print(flops_line(cfg, args.vocab_size, seq_len))
    print("fits" if p.fits else "does not fit")
    return 0 if p.fits else 1


def flops_line(cfg: Config, vocab_size: int, seq_len: int) -> str:
    """MFU's numerator for the config's network (`causal_lm.flops_per_token`, built on the meta
    device): `training FLOPs per token: 6·N + 12·L·h·s = ...`, or why a mixture of experts has none."""
    import torch

    from raytrain_ft.model.causal_lm import build_model, flops_per_token

    with torch.device("meta"):
        model: typing.Any = build_model(cfg.model, vocab_size, seq_len)
    flops = flops_per_token(model, seq_len)
    if flops is None:
        return "training FLOPs per token: none (a mixture of experts: MFU is not reported)"
    c = model.config
    n = (flops - 12 * c.num_hidden_layers * c.hidden_size * seq_len) / 6
    return (
        f"training FLOPs per token (MFU's numerator, PaLM App. B): 6·N + 12·L·h·s = 6·{n / 1e9:.2f}e9 + "
        f"12·{c.num_hidden_layers}·{c.hidden_size}·{seq_len} = {flops:.3e}"
    )


# plan-memory flag (argparse dest) -> config key
MEMORY_FLAGS = {
    "preset": "model.preset",
    "hf_config": "model.hf_config",
    "strategy": "parallel.strategy",
    "shard_size": "parallel.shard_size",
    "micro_batch_size": "train.micro_batch_size",
    "seq_len": "train.seq_len",
    "activation_checkpointing": "parallel.activation_checkpointing",
    "gpu_type": "scaling.gpu_type",
    "gpus_per_node": "scaling.gpus_per_node",
}


def _add_plan_memory(subparsers) -> None:
    p = subparsers.add_parser(
        "plan-memory",
        help="per-GPU memory of a model, strategy and batch; whether it fits",
        description="Bytes per GPU for parameters, gradients, optimizer state, communication buffers and "
        "activations (Korthikanti et al. 2022), and pinned host memory for checkpoint staging, for a config file "
        "and/or the flags below (flags win). Exit status 0 if it fits, 1 if not, 2 on bad input.",
    )
    p.add_argument("--config", default=None, help="a run config YAML (e.g. configs/gpu-7b.yaml)")
    p.add_argument("--preset", default=None, help="model preset (tiny, small, 125m, 1b, 7b, 70b)")
    p.add_argument("--hf-config", default=None, help="a Hugging Face config.json (or folder) of any causal LM")
    p.add_argument("--strategy", default=None, help="ddp, fsdp or hsdp")
    p.add_argument("--world-size", type=int, default=None, help="GPUs in the job (default: the config's minimum)")
    p.add_argument("--shard-size", type=int, default=None, help="hsdp: GPUs per shard group")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per forward/backward")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    p.add_argument("--default-seq-len", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary size of the prepared dataset")
    p.add_argument("--activation-checkpointing", default=None, choices=["true", "false"], help="per decoder layer")
    p.add_argument("--gpu-type", default=None, help="A100-40GB, A100-80GB, H100 or H200 (device memory)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (hsdp default shard size)")
    p.set_defaults(func=_plan_memory)


def _mlflow_run(run: str, tracking_uri: str):
    """(the store's `MlflowClient`, the MLflow `Run` of RUN): `run_resolver.find_run`'s rules."""
    from raytrain_ft.telemetry.run_resolver import find_run, store

    found = find_run(run, tracking_uri)
    return store(found.tracking_uri or tracking_uri), found.mlflow_run(tracking_uri)


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


def _history(args: argparse.Namespace) -> int:
    """Print a run's recovery history, guard events, totals and goodput from MLflow (see
    `raytrain_ft.resilience.recovery`); `--json`: `history_report`'s object instead."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    client, run = _mlflow_run(args.run, args.tracking_uri)
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
    _add_tracking_uri(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (tables, totals, goodput, events)")
    p.set_defaults(func=_history)


def _check(args: argparse.Namespace) -> int:
    """Everything knowable before a worker starts (`raytrain_ft.training.preflight`): one line per problem."""
    from raytrain_ft.core.config import load_config
    from raytrain_ft.core.errors import UserError
    from raytrain_ft.data.position import BatchPlan
    from raytrain_ft.training.preflight import goodput_projection, problems

    try:
        cfg = load_config(args.config, args.overrides)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cluster = None
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address and address.startswith(("http://", "https://")):
        address = None  # the dashboard's job-submission address (`ray job submit`), not a GCS address
    if address:  # connect to a running cluster (never start one) for its resources
        from raytrain_ft.launch.driver import cluster_resources
        from raytrain_ft.training.preflight import check_address

        try:
            if address != "auto":
                check_address(address)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        cluster = cluster_resources(address)
    found = problems(cfg, cluster)
    for problem in found:
        print(f"error: {problem}", file=sys.stderr)
    if found:
        return 2
    lo, hi = cfg.worker_range
    g, m = cfg.train.global_batch_size, cfg.train.micro_batch_size
    balance = min(BatchPlan(g, m, w).batch_balance for w in range(lo, hi + 1))
    resources = "checked" if cluster is not None else "not checked (no Ray cluster address: --address or RAY_ADDRESS)"
    print(
        f"ok: {args.config}: world sizes {lo}-{hi} (lowest batch_balance {balance:.3f}), data, storage and "
        f"tracking checked; cluster resources {resources}"
    )
    if cfg.scaling.use_gpu:  # the default costs are a GPU cluster's (docs/planning.md)
        print(goodput_projection(cfg))
    return 0


def _extend(args: argparse.Namespace) -> int:
    """Record a new `train.max_steps` for a wsd run (see `raytrain_ft.training.extension.extend`)."""
    from raytrain_ft.core.errors import UserError
    from raytrain_ft.telemetry.run_resolver import find_run, store
    from raytrain_ft.telemetry.tracking import MlflowRecorder
    from raytrain_ft.training.extension import extend

    found = find_run(args.run, args.tracking_uri)
    client, run, run_root = (
        store(found.tracking_uri or args.tracking_uri),
        found.mlflow_run(args.tracking_uri),
        found.folder(),
    )
    try:
        recorder = MlflowRecorder(client.tracking_uri, run.info.run_id)
        record = extend(run_root, args.max_steps, recorder)
        recorder.drain()  # writes are sent in the background: before this process exits
    except UserError as e:
        raise ValueError(str(e)) from None
    print(
        f"run {run.info.run_name}: planned for {record['from_max_steps']} steps, checkpoint at step "
        f"{record['at_step']}, now extended to {record['max_steps']}; resubmit it with "
        f"train.max_steps={record['max_steps']}"
    )
    return 0


def _add_check(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="check a run config before submitting it (the driver's preflight, without Ray)",
        description="Run every check the driver's preflight runs, without starting Ray or building a model: "
        "config keys and types, the batch split at every world size of scaling.num_workers, the memory plan "
        "on scaling.gpu_type, the dataset manifest against train.seq_len and the model, that run.storage_path "
        "is writable, that the tracking store answers, the run folder's checkpoints against the config, and "
        "the cluster's resources when connected to Ray. Prints one line per problem; exit status 2 if any.",
    )
    p.add_argument("--config", required=True, help="run config (YAML), e.g. configs/gpu-7b.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for jobs/pretrain.py")
    p.add_argument("--address", default=None, help="a running Ray cluster to check resources against (RAY_ADDRESS)")
    p.set_defaults(func=_check)


def _add_extend(subparsers) -> None:
    p = subparsers.add_parser(
        "extend",
        help="let a wsd run train on to a larger max_steps (before its decay began)",
        description="Record a new train.max_steps for a run with train.lr_schedule=wsd whose newest checkpoint is "
        "before the decay phase; a resubmission with that train.max_steps then trains on as if it had been "
        "planned from the start (docs/extending-runs.md). Cosine runs and runs already decaying are refused.",
    )
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--max-steps", type=int, required=True, help="the new train.max_steps")
    _add_tracking_uri(p)
    p.set_defaults(func=_extend)


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
    _add_tracking_uri(p)
    p.add_argument("--json", action="store_true", help="print one JSON object: {tracking_uri, runs: [rows]}")
    p.set_defaults(func=_runs)


def _export(args: argparse.Namespace) -> int:
    """A checkpoint as a Hugging Face model folder, optionally registered in MLflow (see `raytrain_ft.model.export`)."""
    from raytrain_ft.checkpoint.reader import CheckpointReader
    from raytrain_ft.core.errors import UserError
    from raytrain_ft.model import export
    from raytrain_ft.telemetry.run_resolver import find_run
    from raytrain_ft.telemetry.tracking import resolve_uri

    uri = resolve_uri(args.tracking_uri)
    try:
        checkpoint = export.choose_checkpoint(find_run(args.run, args.tracking_uri).folder(), args.step)
        data = args.data or export.run_data_path(
            uri, CheckpointReader(checkpoint, verified=False).run_meta().mlflow_run_id
        )
        shard = args.max_shard_size or export.DEFAULT_MAX_SHARD_SIZE
        shard = int(shard) if shard.isdigit() else shard
        result = export.export_checkpoint(checkpoint, args.out, data, max_shard_size=shard, dtype=args.dtype)
        print(
            f"exported {checkpoint} (step {result.step}) to {result.out_dir}: {len(result.weight_files)} weight files"
        )
        if args.register:
            version = export.register(result, args.register, uri)
            print(f"registered {args.register} version {version.version} (run {version.run_id})")
    except UserError as e:
        raise ValueError(str(e)) from None
    return 0


def _add_export(subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model folder (config, safetensors, tokenizer)",
        description="Convert one complete checkpoint of a run, written under any strategy and world size, into a "
        "folder `transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load. "
        "Runs on one CPU process with no process group; memory stays within one weight file plus two tensors.",
    )
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest complete one)")
    p.add_argument("--out", required=True, help="the model folder to write (new or empty)")
    p.add_argument(
        "--data",
        default=None,
        help="the run's prepared dataset, for its tokenizer (default: the run's data.path in MLflow)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype")
    p.add_argument("--max-shard-size", default=None, help="largest weight file, bytes or e.g. 500MB (default 5GB)")
    p.add_argument("--register", default=None, metavar="NAME", help="log to the run's MLflow run and register as NAME")
    _add_tracking_uri(p)
    p.set_defaults(func=_export)


def _verify(args: argparse.Namespace) -> int:
    """Check the committed checkpoints of a run: checksums of every stored byte and completeness
    (`raytrain_ft.checkpoint.integrity.verify_checkpoint`); one row each. Exit 1 if any is corrupt."""
    from raytrain_ft.checkpoint.integrity import verify_checkpoint
    from raytrain_ft.core.run_folder import committed_steps, step_path
    from raytrain_ft.telemetry.run_resolver import find_run

    root = find_run(args.run, args.tracking_uri).folder()
    steps = committed_steps(root)
    if args.step is not None:
        if args.step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise ValueError(f"no committed checkpoint step-{args.step} in {root} (committed steps: {have})")
        steps = [args.step]
    if not steps:
        raise ValueError(f"no committed checkpoints in {root}")
    corrupt = 0
    for step in steps:
        problems = verify_checkpoint(step_path(root, step))
        corrupt += bool(problems)
        print(f"step-{step}  " + ("ok" if not problems else "corrupt: " + "; ".join(problems)))
    return 1 if corrupt else 0


def _add_verify(subparsers) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check a run's committed checkpoints: checksums of every stored byte, every component present",
        description="Reads every committed checkpoint of a run (no process group, no Ray) and checks the "
        "checksum of each stored item and of .metadata, and that it holds every component of the train state. "
        "One row per checkpoint: ok, or corrupt with the damaged items. Exit status 0 if all are ok, "
        "1 if any is corrupt, 2 on bad input.",
    )
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--step", type=int, default=None, help="check only the committed checkpoint of this step")
    _add_tracking_uri(p)
    p.set_defaults(func=_verify)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain-ft", description="Fault-tolerant LLM pretraining on Ray Train.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan_interval(subparsers)
    _add_plan_memory(subparsers)
    _add_plan_goodput(subparsers)
    _add_history(subparsers)
    _add_check(subparsers)
    _add_extend(subparsers)
    _add_runs(subparsers)
    _add_export(subparsers)
    _add_verify(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse usage errors also give 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse already printed
        return e.code if isinstance(e.code, int) else 1
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
