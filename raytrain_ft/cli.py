"""The `raytrain-ft` command line. One subcommand per task; add one with a `_add_<name>` function below.

    raytrain-ft plan-interval --mtbf-hours 10000 --gpus 1000 --checkpoint-seconds 300
    raytrain-ft plan-memory --config configs/gpu-7b.yaml [--strategy ddp --micro-batch-size 2 ...]
    raytrain-ft history RUN_NAME_OR_ID [--tracking-uri URI]   (or MLFLOW_TRACKING_URI)
    raytrain-ft check --config configs/gpu-7b.yaml [key=value ...] [--address RAY_ADDRESS]

Errors in the input print one `error: ...` line on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from raytrain_ft import interval


def _plan_interval(args: argparse.Namespace) -> int:
    """Young's and Daly's checkpoint intervals and the expected waste for a cluster (see `raytrain_ft.interval`)."""
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


def _plan_memory(args: argparse.Namespace) -> int:
    """Per-device memory of a config or of explicit settings, and whether it fits (see `raytrain_ft.memory`)."""
    from rich.console import Console
    from rich.table import Table

    from raytrain_ft import memory
    from raytrain_ft.config import load_config
    from raytrain_ft.errors import ConfigError

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
        title=f"Memory per GPU: {cfg.model.preset}, {strategy}, {cfg.worker_range[0]} GPUs, seq_len {seq_len}"
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
    print("fits" if p.fits else "does not fit")
    return 0 if p.fits else 1


# plan-memory flag (argparse dest) -> config key
MEMORY_FLAGS = {
    "preset": "model.preset",
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


def _history(args: argparse.Namespace) -> int:
    """Print a run's recovery history, guard events, totals and goodput from MLflow (see `raytrain_ft.recovery`)."""
    from mlflow.tracking import MlflowClient
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from raytrain_ft import recovery
    from raytrain_ft.tracking import RunLogger, resolve_uri

    uri = resolve_uri(args.tracking_uri)
    if uri.startswith("sqlite:///") and not os.path.exists(uri.removeprefix("sqlite:///")):  # MLflow would create it
        raise ValueError(
            f"no MLflow store at {uri}; point --tracking-uri (or MLFLOW_TRACKING_URI) at the store the run logged to"
        )
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    matches = client.search_runs(experiments, f"attributes.run_id = '{args.run}'") if len(args.run) == 32 else []
    matches = matches or client.search_runs(experiments, f"attributes.run_name = '{args.run}'")
    if not matches:
        raise ValueError(
            f"no MLflow run named or with id {args.run!r} in {uri}; check the name, "
            "or point --tracking-uri (or MLFLOW_TRACKING_URI) at the store the run logged to"
        )
    run = matches[0]
    events = RunLogger(uri, run.info.run_id).events()
    console = Console(width=200)
    console.print(f"run {run.info.run_name} ({run.info.run_id}), status {run.info.status}")
    for title, rows in (
        ("Recovery history", recovery.recovery_rows(events)),
        ("Guard events", recovery.guard_rows(events)),
    ):
        table = Table(title=title)
        keys = list(rows[0]) if rows else ["(none)"]
        for key in keys:
            table.add_column(key)
        for row in rows:
            table.add_row(*(escape(str(row[k])) for k in keys))  # causes contain "[...]"
        console.print(table)
    totals = recovery.totals(recovery.recovery_rows(events))
    console.print(", ".join(f"{k} {v:g}" for k, v in totals.items()))
    console.print(_goodput_table(run.data.metrics))
    return 0


def _goodput_table(metrics: dict[str, float]):
    """The latest goodput summary (`raytrain_ft.goodput`): productive time and each badput part."""
    from rich.table import Table

    from raytrain_ft.goodput import PARTS

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
    p.add_argument("run", help="MLflow run name (run.name) or run id")
    p.add_argument(
        "--tracking-uri",
        default="",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///$HOME/raytrain-ft/mlflow.db, "
        "where a run without tracking.uri logs)",
    )
    p.set_defaults(func=_history)


def _check(args: argparse.Namespace) -> int:
    """Everything knowable before a worker starts (`raytrain_ft.preflight`): one line per problem."""
    from raytrain_ft.config import load_config
    from raytrain_ft.data.position import BatchPlan
    from raytrain_ft.errors import UserError
    from raytrain_ft.preflight import problems

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
        import ray

        from raytrain_ft.preflight import check_address

        try:
            if address != "auto":
                check_address(address)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        cluster = ray.cluster_resources()
        ray.shutdown()
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain-ft", description="Fault-tolerant LLM pretraining on Ray Train.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan_interval(subparsers)
    _add_plan_memory(subparsers)
    _add_history(subparsers)
    _add_check(subparsers)
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
