"""`raytrain-ft extend`, `export` and `verify`: what may be done with a run's committed checkpoints."""

from __future__ import annotations

import argparse
import typing

from raytrain_ft.cli.common import RUN_HELP, add_tracking_uri

if typing.TYPE_CHECKING:
    pass


def _extend(args: argparse.Namespace) -> int:
    """Record a new `train.max_steps` for a wsd run (see `raytrain_ft.training.extension.extend`)."""
    from raytrain_ft.telemetry.run_resolver import find_run, store
    from raytrain_ft.telemetry.tracking import MlflowRecorder
    from raytrain_ft.training.extension import extend

    found = find_run(args.run, args.tracking_uri)
    client, run, run_root = (
        store(found.tracking_uri or args.tracking_uri),
        found.mlflow_run(args.tracking_uri),
        found.folder(),
    )
    recorder = MlflowRecorder(client.tracking_uri, run.info.run_id)
    record = extend(run_root, args.max_steps, recorder)
    recorder.drain()  # writes are sent in the background: before this process exits
    print(
        f"run {run.info.run_name}: planned for {record['from_max_steps']} steps, checkpoint at step "
        f"{record['at_step']}, now extended to {record['max_steps']}; resubmit it with "
        f"train.max_steps={record['max_steps']}"
    )
    return 0


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
    add_tracking_uri(p)
    p.set_defaults(func=_extend)


def _export(args: argparse.Namespace) -> int:
    """A checkpoint as a Hugging Face model folder, optionally registered in MLflow (see `raytrain_ft.model.export`)."""
    from raytrain_ft.checkpoint.reader import CheckpointReader
    from raytrain_ft.model import export
    from raytrain_ft.telemetry.run_resolver import find_run
    from raytrain_ft.telemetry.tracking import resolve_uri

    uri = resolve_uri(args.tracking_uri)
    checkpoint = export.choose_checkpoint(find_run(args.run, args.tracking_uri).folder(), args.step)
    data = args.data or export.run_data_path(uri, CheckpointReader(checkpoint, verified=False).run_meta().mlflow_run_id)
    shard = args.max_shard_size or export.DEFAULT_MAX_SHARD_SIZE
    shard = int(shard) if shard.isdigit() else shard
    result = export.export_checkpoint(checkpoint, args.out, data, max_shard_size=shard, dtype=args.dtype)
    print(f"exported {checkpoint} (step {result.step}) to {result.out_dir}: {len(result.weight_files)} weight files")
    if args.register:
        version = export.register(result, args.register, uri)
        print(f"registered {args.register} version {version.version} (run {version.run_id})")
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
    add_tracking_uri(p)
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
    add_tracking_uri(p)
    p.set_defaults(func=_verify)


def add_parsers(subparsers) -> None:
    """Add this module's commands to `subparsers`."""
    _add_extend(subparsers)
    _add_export(subparsers)
    _add_verify(subparsers)
