"""`raytrain-ft plan-interval`, `plan-goodput` and `plan-memory`: plans made before a run, from figures or a config."""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import asdict

from raytrain_ft.checkpoint import interval
from raytrain_ft.cli.common import RUN_HELP, add_tracking_uri, mlflow_run

if typing.TYPE_CHECKING:
    from raytrain_ft.core.config import Config


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

    client, run = mlflow_run(run_name, tracking_uri)
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
    add_tracking_uri(p)
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

    from raytrain_ft.core.config_files import load_config
    from raytrain_ft.model import memory
    from raytrain_ft.model.causal_lm import model_name

    overrides = [
        f"{key}={getattr(args, dest)}" for dest, key in MEMORY_FLAGS.items() if getattr(args, dest) is not None
    ]
    if args.world_size is not None:
        overrides.append(f"scaling.num_workers={args.world_size}")
    if args.vocab_size < 1:
        raise ValueError(f"--vocab-size must be positive, got {args.vocab_size}")
    cfg = load_config(args.config, ["scaling.use_gpu=true", *overrides])  # the plan is for GPUs
    seq_len = cfg.train.seq_len or args.default_seq_len
    p = memory.plan_config(cfg, args.vocab_size, seq_len)
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

    from raytrain_ft.model.causal_lm import build_model, flops_per_token, matmul_params

    with torch.device("meta"):
        model: typing.Any = build_model(cfg.model, vocab_size, seq_len)
    flops = flops_per_token(model, seq_len)
    if flops is None:
        return "training FLOPs per token: none (a mixture of experts: MFU is not reported)"
    c = model.config
    n = matmul_params(model)
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


def add_parsers(subparsers) -> None:
    """Add this module's commands to `subparsers`."""
    _add_plan_interval(subparsers)
    _add_plan_goodput(subparsers)
    _add_plan_memory(subparsers)
