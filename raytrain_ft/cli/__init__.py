"""The `raytrain-ft` command line. One subcommand per task; one module per command group (`plans`,
`runs`, `checks`, `checkpoints`), each with its `add_parsers`.

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
import sys
from collections.abc import Sequence

from raytrain_ft.cli import checkpoints, checks, plans, runs
from raytrain_ft.core.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser, each command's `func` set (`args.func(args)` runs it)."""
    parser = argparse.ArgumentParser(prog="raytrain-ft", description="Fault-tolerant LLM pretraining on Ray Train.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (plans, runs, checks, checkpoints):
        group.add_parsers(subparsers)
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
    except (ValueError, UserError) as e:  # bad input: one line, never a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
