"""`raytrain-ft check`: a run config checked as the driver's preflight does, without Ray."""

from __future__ import annotations

import argparse
import os
import sys
import typing

if typing.TYPE_CHECKING:
    pass


def _check(args: argparse.Namespace) -> int:
    """Everything knowable before a worker starts (`raytrain_ft.training.preflight`): one line per problem."""
    from raytrain_ft.core.config_files import load_config
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


def add_parsers(subparsers) -> None:
    """Add this module's commands to `subparsers`."""
    _add_check(subparsers)
