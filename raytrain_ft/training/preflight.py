"""Everything about a run that can be known before a worker starts: `problems(cfg)`.

One function serves the driver (`raytrain_ft.launch.driver.preflight` raises the first problem
before `TorchTrainer.fit`) and `raytrain-ft check --config FILE` (prints every problem, one line
each). It never builds a model's weights and never starts Ray: the config's keys and types are
checked by `raytrain_ft.core.config_files.load_config` before it is called; here come

- the batch split at every world size of `scaling.num_workers` (`BatchPlan`) and the HSDP mesh;
- that `failure.recovery: replica` has what it needs (fixed workers, ddp, torchft);
- the dataset's manifest (when `data.path` is reachable) against `train.seq_len`, the batch and
  the model (preset or config), and a `model.init_from` folder's weights and tokenizer;
- the memory plan on the configured `scaling.gpu_type` (GPU runs);
- that the waits' bounds can work together (`raytrain_ft.core.waits.conflicts`);
- that `run.storage_path` is reachable and writable (a probe file is written and removed);
- that the tracking store answers (`GET /health` of an `http(s)://` server; a SQLite file's folder
  exists and is writable). A deliberate refusal: the driver opens the run's MLflow run before any
  worker starts, so a store that does not answer would stop it there anyway, less clearly;
- the resources of the Ray cluster, when the caller is connected to one (`cluster`);
- the run folder: Ray's record of its committed checkpoints, and the newest checkpoint's
  fingerprint against this config (a resubmission that changed the model, data or schedule).
"""

from __future__ import annotations

import http.client
import importlib.util
import os
import socket
import urllib.request
from collections.abc import Callable

import fsspec

from raytrain_ft.checkpoint.fingerprint import check_fingerprint, fingerprint
from raytrain_ft.checkpoint.memory_copies import KEEP, bytes_per_node, free_bytes
from raytrain_ft.checkpoint.reader import newest_checkpoint
from raytrain_ft.checkpoint.train_state import RunMeta
from raytrain_ft.core.config import Config
from raytrain_ft.core.errors import CheckpointError, ConfigError, UserError
from raytrain_ft.core.run_folder import (
    RAY_RUN_STATE,
    complete_steps,
    has_run_state,
    read_extensions,
    read_latest,
    run_root,
)
from raytrain_ft.core.waits import conflicts
from raytrain_ft.data.batches import check_data_fits
from raytrain_ft.data.manifest import Manifest, load_manifest
from raytrain_ft.data.position import check_world_sizes
from raytrain_ft.model.causal_lm import model_config
from raytrain_ft.model.memory import check_fits, plan_config
from raytrain_ft.model.parallel import mesh_shape, resolve_strategy
from raytrain_ft.model.pretrained import check_init_from
from raytrain_ft.telemetry.tracking import resolve_uri

PROBE_TIMEOUT_S = 5.0


def problems(cfg: Config, cluster: dict[str, float] | None = None) -> list[UserError]:
    """Every problem found, in the order the checks run (empty: the run can start).

    Args:
        cluster: the Ray cluster's total resources (`ray.cluster_resources()`), or None when not
            connected to one (that check is skipped).
    """
    found: list[UserError] = []

    def check(fn: Callable[[], object]) -> bool:
        try:
            fn()
            return True
        except UserError as e:
            found.append(e)
            return False

    lo, hi = cfg.worker_range
    check(lambda: check_world_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, range(lo, hi + 1)))
    check(lambda: check_meshes(cfg))
    check(lambda: check_recovery(cfg))
    manifest: list[Manifest] = []
    if check(lambda: manifest.append(load_manifest(cfg.data.path))):
        m = manifest[0]
        check(lambda: model_config(cfg.model, m.vocab_size, m.seq_len))
        check(lambda: check_data_fits(cfg, m))
        if cfg.scaling.use_gpu:
            check(lambda: check_fits(cfg, m.vocab_size, m.seq_len))
        if cfg.checkpoint.memory.enabled:
            check(lambda: check_memory_tier(cfg, m))
    check(lambda: check_bounds(cfg, manifest[0] if manifest else None))
    check(lambda: check_tracking(resolve_uri(cfg.tracking.uri)))
    if cluster is not None:
        check(lambda: check_resources(cfg, cluster))
    root = run_root(cfg.run.storage_path, cfg.run.name)
    storage_ok = check(lambda: check_writable(cfg.run.storage_path))
    if storage_ok and check(lambda: check_run_state(root)) and manifest:
        check(lambda: check_checkpoint_compatible(cfg, manifest[0], root))
    if manifest and not (storage_ok and newest_checkpoint(root)):  # a resume does not read the weights
        check(lambda: check_init_from(cfg.model, cfg.data.path, manifest[0]))
    return found


def check_bounds(cfg: Config, manifest: Manifest | None) -> None:
    """Raises ConfigError: the first pair of bounds that cannot work together (`waits.conflicts`;
    on GPU runs with a readable manifest the slowest checkpoint stage comes from the memory plan:
    one rank's parameters and optimizer state)."""
    written = None
    if cfg.scaling.use_gpu and manifest is not None:
        plan = plan_config(cfg, manifest.vocab_size, manifest.seq_len)
        written = plan.params + plan.optimizer
    found = conflicts(cfg, written)
    if found:
        raise ConfigError(found[0])


def check_memory_tier(cfg: Config, manifest: Manifest) -> None:
    """Raises ConfigError: the memory tier's copies would not fit a node (`memory_copies.bytes_per_node`:
    one rank's parameters and optimizer state, from the memory plan, x its ranks per node: the GPUs of
    one node, or on CPU every worker of the range; against `checkpoint.memory.max_bytes_per_node`,
    else the free bytes of `checkpoint.memory.dir` on this machine)."""
    m = cfg.checkpoint.memory
    plan = plan_config(cfg, manifest.vocab_size, manifest.seq_len)
    hi = cfg.worker_range[1]
    ranks = min(cfg.scaling.gpus_per_node, hi) if cfg.scaling.use_gpu else hi
    needed = bytes_per_node(plan.params + plan.optimizer, ranks, m.peer_copies)
    limit = m.max_bytes_per_node or free_bytes(m.dir)
    if needed > limit:
        source = "checkpoint.memory.max_bytes_per_node" if m.max_bytes_per_node else f"free in {m.dir} here"
        raise ConfigError(
            f"the memory tier needs about {needed / 2**30:.1f} GiB per node ({ranks} ranks x "
            f"{(plan.params + plan.optimizer) / 2**30:.2f} GiB x {1 + m.peer_copies} copies x {KEEP + 1} steps) but "
            f"{limit / 2**30:.1f} GiB are {source}; lower checkpoint.memory.peer_copies, use a node with more "
            "memory, or turn the tier off (checkpoint.memory.interval_steps=0)"
        )


def check_meshes(cfg: Config) -> None:
    """Raises ConfigError: hsdp's `shard_size` does not divide some world size of the range."""
    lo, hi = cfg.worker_range
    strategy = resolve_strategy(cfg.parallel, cfg.scaling.use_gpu)
    for world_size in range(lo, hi + 1):
        mesh_shape(strategy, world_size, cfg.parallel.shard_size or min(cfg.scaling.gpus_per_node, world_size))


def check_recovery(cfg: Config) -> None:
    """`failure.recovery: replica` needs what Ray Train 2.60's replica groups give: one worker per
    replica, each holding the full model, a fixed number of them; and torchft installed.

    Raises:
        ConfigError: an elastic `scaling.num_workers` range, a sharded strategy (fsdp, hsdp; also
            `auto` on GPUs), or torchft missing; one line each, with the fix.
    """
    if cfg.failure.recovery != "replica":
        return
    lo, hi = cfg.worker_range
    if lo != hi:
        raise ConfigError(
            f"failure.recovery=replica needs a fixed scaling.num_workers, got {cfg.scaling.num_workers}: Ray Train "
            "falls back to a full restart on an elastic resize; set scaling.num_workers to one number"
        )
    strategy = resolve_strategy(cfg.parallel, cfg.scaling.use_gpu)
    if strategy != "ddp":
        raise ConfigError(
            f"failure.recovery=replica needs parallel.strategy=ddp, got {strategy} (from {cfg.parallel.strategy}): "
            "Ray Train 2.60 runs one worker per replica group, so every replica holds the full model"
        )
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError("failure.recovery=replica needs torchft: pip install -e '.[ft]'")


def check_writable(storage_path: str) -> None:
    """Create `storage_path` if needed and write and remove a probe file there.

    Raises:
        ConfigError: unreachable or not writable (missing credentials, no fsspec backend, permissions).
    """
    probe = f"{storage_path.rstrip('/')}/.raytrain-ft-check-{os.getpid()}"
    try:
        fs, base = fsspec.core.url_to_fs(storage_path)
        fs.makedirs(base, exist_ok=True)
        with fsspec.open(probe, "wb") as f:
            f.write(b"ok")
        fs.rm(fsspec.core.url_to_fs(probe)[1])
    except ImportError as e:
        raise ConfigError(f"run.storage_path={storage_path} needs a file system package: {e}") from None
    except Exception as e:  # fsspec backends raise their own types (botocore, gcsfs, OSError)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"run.storage_path={storage_path} is not writable ({reason}); fix the path, its permissions or credentials"
        ) from None


def check_tracking(uri: str) -> None:
    """Raises ConfigError: an `http(s)://` tracking server that does not answer `GET /health`, or a
    SQLite store whose folder is missing or not writable. Other URIs (databricks, ...) pass."""
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S) as r:
                if r.status == 200:
                    return
                reason = f"HTTP {r.status}"
        except (OSError, http.client.HTTPException, ValueError) as e:  # refused, not HTTP, a malformed URL
            reason = str(getattr(e, "reason", e)) or type(e).__name__
        raise ConfigError(f"tracking.uri={uri} does not answer ({reason}); start the MLflow server or fix tracking.uri")
    if uri.startswith("sqlite:///"):
        folder = os.path.abspath(os.path.dirname(uri.removeprefix("sqlite:///")) or ".")
        existing = folder
        while not os.path.exists(existing):  # MLflow creates a SQLite store's missing folders
            existing = os.path.dirname(existing)
        if not (os.path.isdir(existing) and os.access(existing, os.W_OK)):
            raise ConfigError(
                f"tracking.uri={uri}: folder {folder} cannot be created or written ({existing} is not a writable "
                "folder); fix tracking.uri or the folder's permissions"
            )


def check_address(address: str) -> None:
    """Raises ConfigError: nothing listens at a Ray cluster's `host:port` (a TCP connect with a
    timeout, so `ray.init` is never left retrying an address that cannot answer)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"Ray cluster address {address} does not answer ({e}); give the head's host:port (ray start --head "
            "prints it) or leave --address and RAY_ADDRESS unset to skip the resources check"
        ) from None


def check_resources(cfg: Config, cluster: dict[str, float]) -> None:
    """Raises ConfigError: the cluster cannot hold the smallest world size of the range."""
    lo, _ = cfg.worker_range
    need = {"CPU": lo * cfg.scaling.cpus_per_worker, "GPU": lo if cfg.scaling.use_gpu else 0}
    for res, amount in need.items():
        if amount > cluster.get(res, 0):
            fix = "scaling.cpus_per_worker" if res == "CPU" else "set scaling.use_gpu=false"
            raise ConfigError(
                f"scaling.num_workers={cfg.scaling.num_workers} needs {amount:g} {res} but the Ray cluster has "
                f"{cluster.get(res, 0):g}; lower scaling.num_workers or {fix}, or add {res} nodes"
            )


def check_run_state(run_root: str) -> None:
    """Refuse to start when complete checkpoints exist but Ray Train's record of them is gone.

    Ray's run state (`checkpoint_manager_snapshot.json` in the run folder) is what says which
    checkpoint is committed; without it the workers would see a fresh start and delete every
    `step-*` folder as uncommitted. Raising instead loses nothing.

    Raises:
        CheckpointError: with the steps found and how to resume or start over.
    """
    complete = complete_steps(run_root)
    # replica recovery commits in `latest_checkpoint` instead (`raytrain_ft.launch.worker.ReplicaSession`)
    if complete and not has_run_state(run_root) and read_latest(run_root) is None:
        raise CheckpointError(
            f"{run_root} holds complete checkpoints (steps {', '.join(map(str, complete))}) but no {RAY_RUN_STATE}, "
            "Ray Train's record of which one is committed; restore that file to resume, or move the step-* "
            "folders away (or choose a new run.name) to start over"
        )


def check_checkpoint_compatible(cfg: Config, manifest, run_root: str) -> None:
    """Compare the newest complete checkpoint's fingerprint with this config (no workers needed).
    A changed `train.max_steps` alone passes only while the schedule allows it (`check_fingerprint`,
    the restore's comparison too) and as the target `raytrain-ft extend` last recorded (`check_extended`)."""
    newest = newest_checkpoint(run_root)
    if newest is None:
        return
    path, saved = newest
    import torch

    from raytrain_ft.model.causal_lm import build_model, model_id

    with torch.device("meta"):  # shapes only: no weights are allocated
        num_params = sum(p.numel() for p in build_model(cfg.model, manifest.vocab_size, manifest.seq_len).parameters())
    current = fingerprint(cfg, manifest, num_params, model_id(cfg.model))
    if check_fingerprint(path, saved.fingerprint, current) is not None:
        check_extended(cfg, run_root, path, saved)


def check_extended(cfg: Config, run_root: str, path: str, saved: RunMeta) -> None:
    """Raise unless `cfg.train.max_steps` is the run's last recorded extension (`raytrain-ft extend`)
    of the checkpoint at `path` (fingerprint in `saved`; that the schedule allows it is
    `check_fingerprint`'s).

    Raises:
        CheckpointError: one line naming `raytrain-ft extend`.
    """
    planned, target = saved.fingerprint["train.max_steps"], cfg.train.max_steps
    recorded = read_extensions(run_root)
    if not recorded or recorded[-1]["max_steps"] != target:
        now = f"; its last extension is to {recorded[-1]['max_steps']}" if recorded else ""
        raise CheckpointError(
            f"checkpoint {path} was planned for train.max_steps={planned} but the config says {target}{now}; to train "
            f"a wsd run further run `raytrain-ft extend {cfg.run.name} --max-steps {target}` first, else use the "
            "original max_steps or a new run.name"
        )


def goodput_projection(cfg: Config) -> str:
    """One line: the month's goodput `raytrain_ft.resilience.planner` projects for `cfg` at its `max` workers
    (GPUs, or workers on CPU) with `failure.mtbf_hours_per_gpu`, in its `failure.recovery` mode, at
    its checkpoint interval (`planner.config_interval_s`), with `planner.DEFAULT_COSTS`: the project
    has no estimate of a run's costs before it ran (their 10 s step is `configs/gpu-7b.yaml`'s on 64
    A100s at 40 % MFU); a run's measured ones are `raytrain-ft plan-goodput --from-run RUN`'s.
    `raytrain-ft check` prints it for GPU configs."""
    from raytrain_ft.resilience import planner

    costs, workers = planner.DEFAULT_COSTS, cfg.worker_range[1]
    cluster = planner.Cluster(workers, cfg.failure.mtbf_hours_per_gpu)
    mode = cfg.failure.recovery if workers >= 2 else "restart"
    interval = planner.config_interval_s(cfg.checkpoint.interval, cfg.checkpoint.interval_steps, costs, cluster.mtbf_s)
    p = planner.plan(cluster, costs, (mode,), interval, repetitions=100)["modes"][mode]
    lo, hi = p["goodput_ci95"]
    return (
        f"goodput: {p['goodput']:.3f} (95 % of months {lo:.3f}-{hi:.3f}) projected for {workers} workers in {mode} "
        f"mode at a checkpoint every {interval / 60:.0f} min, MTBF {cluster.mtbf_s / 3600:.1f} h, default costs "
        f"(planner.DEFAULT_COSTS; measured ones: raytrain-ft plan-goodput --from-run RUN)"
    )
