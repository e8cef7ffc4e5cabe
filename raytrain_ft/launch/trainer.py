"""Driver side: validate up front, create/reuse the MLflow run, build and fit the `TorchTrainer`."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import fsspec
import ray
import torch
from ray.exceptions import RayActorError
from ray.train import CheckpointConfig, ControllerError, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain_ft.checkpoint import RAY_RUN_STATE, list_step_dirs, step_path
from raytrain_ft.config import Config, to_dict
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.position import check_world_sizes
from raytrain_ft.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    UserError,
    find_user_error,
    raise_if_ended,
)
from raytrain_ft.launch.callbacks import RunRecorder, describe, plain_cause
from raytrain_ft.launch.tracking_actor import close, start_tracking_actor
from raytrain_ft.launch.tracking_server import history_uri, lasting_path, tracking_store
from raytrain_ft.launch.worker import train_func
from raytrain_ft.loop import check_data_fits, fingerprint
from raytrain_ft.memory import check_fits
from raytrain_ft.model import build_model, model_config
from raytrain_ft.parallel import mesh_shape, resolve_strategy
from raytrain_ft.recovery import GROUP_START, failures, root_first, who
from raytrain_ft.tracking import RunLogger, flatten, resolve_uri, start_or_resume_run
from raytrain_ft.train_state import RunMeta

log = logging.getLogger(__name__)

# Propagated to every Ray Train worker and the controller (runtime_env).
WORKER_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",  # default 2 s: reports and failures noticed sooner
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # worker prints appear once
    # A failed or timed-out NCCL collective tears the process down instead of hanging; the timeout is
    # the process group's (TorchConfig(timeout_s=failure.collective_timeout_s)): NCCL_TIMEOUT alone is
    # not read by PyTorch.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_BLOCKING_WAIT": "1",  # wait() raises on timeout rather than blocking forever
}

# Ray kills a node's idle worker processes beyond its *available* CPUs after 1 s (ray-project/ray#36766).
# The training workers reserve the CPUs, so the 0-CPU read tasks of Ray Data (launch/datasource.py)
# lost their idle workers between tasks, and after every restart the raylet started new Python
# processes for them: ~1 s of CPU each on the recovery's critical path (benchmarks/goodput.py; a
# profile showed two per restart). Every raylet keeps this many idle workers instead. Read by the
# raylet from its environment: set where Ray starts (`ray start` in scripts/demo.sh and cluster.yaml;
# `os.environ.update(RAY_NODE_ENV)` before a local `ray.init`, as jobs/pretrain.py does).
RAY_NODE_ENV = {"RAY_num_workers_soft_limit": "16"}


class RunFailed(UserError):
    """The run used up `failure.max_failures` restarts."""


class Terminated(BaseException):
    """SIGTERM reached the driver (`ray job stop`, the head being preempted)."""


class _OnSigterm:
    """SIGTERM handler: remembers the signal and interrupts `fit()`. Raised inside Ray's C code the
    exception may come out wrapped (e.g. as a SystemError), so the driver checks `signalled`."""

    signalled = False

    def __call__(self, signum: int, frame) -> None:
        self.signalled = True
        raise Terminated("stopped by SIGTERM")


def preflight(cfg: Config) -> None:
    """Catch user errors before any worker starts (each raises a one-line `UserError`)."""
    manifest = load_manifest(cfg.data.path)
    model_config(cfg.model.preset, manifest.vocab_size, manifest.seq_len, cfg.model.dropout)  # a valid preset
    check_data_fits(cfg, manifest)
    lo, hi = cfg.worker_range
    check_world_sizes(cfg.train.global_batch_size, cfg.train.micro_batch_size, range(lo, hi + 1))
    strategy = resolve_strategy(cfg.parallel, cfg.scaling.use_gpu)
    for world_size in range(lo, hi + 1):
        mesh_shape(strategy, world_size, cfg.parallel.shard_size or min(cfg.scaling.gpus_per_node, world_size))
    if cfg.scaling.use_gpu:
        check_fits(cfg, manifest.vocab_size, manifest.seq_len)
    need = {"CPU": lo * cfg.scaling.cpus_per_worker, "GPU": lo if cfg.scaling.use_gpu else 0}
    have = ray.cluster_resources()
    for res, amount in need.items():
        if amount > have.get(res, 0):
            fix = "scaling.cpus_per_worker" if res == "CPU" else "set scaling.use_gpu=false"
            raise ConfigError(
                f"scaling.num_workers={cfg.scaling.num_workers} needs {amount:g} {res} but the Ray cluster has "
                f"{have.get(res, 0):g}; lower scaling.num_workers or {fix}, or add {res} nodes"
            )
    run_root = os.path.join(cfg.run.storage_path, cfg.run.name)
    check_run_state(run_root)
    check_checkpoint_compatible(cfg, manifest, run_root)


def check_run_state(run_root: str) -> None:
    """Refuse to start when complete checkpoints exist but Ray Train's record of them is gone.

    Ray's run state (`checkpoint_manager_snapshot.json` in the run folder) is what says which
    checkpoint is committed; without it the workers would see a fresh start and delete every
    `step-*` folder as uncommitted. Raising instead loses nothing.

    Raises:
        CheckpointError: with the steps found and how to resume or start over.
    """
    complete = sorted(s for s, done in list_step_dirs(run_root).items() if done)
    fs, base = fsspec.core.url_to_fs(run_root)
    if complete and not fs.exists(f"{base.rstrip('/')}/{RAY_RUN_STATE}"):
        raise CheckpointError(
            f"{run_root} holds complete checkpoints (steps {', '.join(map(str, complete))}) but no {RAY_RUN_STATE}, "
            "Ray Train's record of which one is committed; restore that file to resume, or move the step-* "
            "folders away (or choose a new run.name) to start over"
        )


def check_checkpoint_compatible(cfg: Config, manifest, run_root: str) -> None:
    """Compare the newest intact complete checkpoint's fingerprint with this config (no workers needed);
    corrupt ones are skipped here and recorded by the workers' restore, which falls back past them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from raytrain_ft.checkpoint import corruption_of
    from raytrain_ft.integrity import ChecksummedReader
    from raytrain_ft.train_state import KEY_META

    complete = sorted((s for s, done in list_step_dirs(run_root).items() if done), reverse=True)
    if not complete:
        return
    with torch.device("meta"):
        num_params = sum(
            p.numel() for p in build_model(cfg.model.preset, manifest.vocab_size, manifest.seq_len, 0.0).parameters()
        )
    current = fingerprint(cfg, manifest, num_params)
    for step in complete:
        path, saved = step_path(run_root, step), RunMeta(fingerprint={})
        reader = ChecksummedReader(path)
        try:
            reader.read_metadata()  # checked here: inside dcp.load DCP reports it as a bare AssertionError
            dcp.load({KEY_META: saved}, storage_reader=reader, no_dist=True)
        except (CorruptCheckpointError, CheckpointException) as e:
            if corruption_of(e) is None:
                raise
            continue
        diff = [
            f"{k}: checkpoint {saved.fingerprint.get(k)} vs config {v}"
            for k, v in current.items()
            if saved.fingerprint.get(k) != v
        ]
        if diff:
            raise CheckpointError(
                f"checkpoint {path} belongs to a different model or dataset ({', '.join(diff)}); "
                "use the original settings or a new run.name"
            )
        return


MAX_LINE = 300


def failure_line(cfg: Config, logger: RunLogger, started: float, fallback: str) -> str:
    """The job's last line when the run used up `failure.max_failures` (under `MAX_LINE` characters):
    run name, restarts used, the root-cause rank, its last completed step, the plain cause
    (`callbacks.plain_cause`), and the command that shows the whole history. `started`: when this
    submission's `fit()` began (unix seconds; earlier submissions' failures are not counted)."""
    try:
        these = [f for _, f in failures(logger.events()) if f["time"] >= started]
    except Exception:  # the tracking store is unreachable: say what Ray said
        these = []
    uri = history_uri(cfg.tracking.uri)
    history = f"raytrain-ft history {cfg.run.name}" + (f" --tracking-uri {uri}" if uri != resolve_uri("") else "")
    if these:
        rank, cause = root_first(these[-1]["causes"])[0]
        where = f"{who(rank)} after step {these[-1]['last_step']}"
    else:
        where, cause = "", fallback
    head = f"run {cfg.run.name} failed after {max(len(these) - 1, 0)}/{cfg.failure.max_failures} restarts: {where}"
    tail = f"; details: {history}"
    room = MAX_LINE - 1 - len(head) - len(tail) - 2
    cause = cause if len(cause) <= room else cause[: max(room - 3, 0)] + "..."
    return f"{head}{': ' if where else ''}{cause}{tail}"


def run(cfg: Config) -> str:
    """Run (or resume) the training run described by `cfg`; return the MLflow run id.

    Raises:
        UserError: a configuration/data/checkpoint problem, or the run failed more than
            `failure.max_failures` times (message names the last cause).
    """
    cfg.data.path = lasting_path(cfg.data.path, "data.path")
    cfg.run.storage_path = lasting_path(cfg.run.storage_path, "run.storage_path")
    preflight(cfg)
    with tracking_store(cfg.tracking.uri) as uri:
        return _fit(cfg, uri)


def _torch_trainer(cfg: Config, tracking, run_id: str, run_root: str, max_failures: int) -> TorchTrainer:
    lo, hi = cfg.worker_range
    return TorchTrainer(
        train_func,
        train_loop_config={"config": to_dict(cfg), "tracking": tracking, "mlflow_run_id": run_id},
        scaling_config=ScalingConfig(
            num_workers=lo if lo == hi else (lo, hi),
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker, **({"GPU": 1} if cfg.scaling.use_gpu else {})},
            elastic_resize_monitor_interval_s=cfg.scaling.resize_check_interval_s,
        ),
        torch_config=TorchConfig(
            backend="nccl" if cfg.scaling.use_gpu else "gloo", timeout_s=cfg.failure.collective_timeout_s
        ),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=cfg.run.storage_path,
            failure_config=FailureConfig(max_failures=max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
            callbacks=[RunRecorder(tracking, run_root)],
        ),
    )


def failed_during_group_start(e: BaseException) -> bool:
    """Whether `fit()` ended on a worker that died while Ray Train started the worker group.

    Ray Train 2.60 retries a controller error only when it wraps `WorkerGroupStartupFailedError`
    or `WorkerGroupStartupTimeoutError` (`ray/train/v2/_internal/execution/failure_handling/default.py`);
    a worker actor that dies after the group's setup, while the controller launches the train
    function (`WorkerGroup._start_impl`), raises `ActorDiedError` there unwrapped, and the failure
    policy ends the run however many restarts are left."""
    return isinstance(e, ControllerError) and isinstance(e.controller_failure, RayActorError)


def restarts_left(logger: RunLogger, started: float, max_failures: int) -> int:
    """`failure.max_failures` minus the failures of this submission (since unix time `started`), each of
    which was (or is about to be) followed by a restart: what the next `fit()` may still use; negative
    when the limit is used up. Counted from the run's `failure` events, as the failure line and the
    recovery history count them."""
    return max_failures - len([f for _, f in failures(logger.events()) if f["time"] >= started])


def _fit(cfg: Config, uri: str) -> str:
    """Fit until the run finishes. A worker lost while Ray Train starts the group
    (`failed_during_group_start`) is recorded as a failure like any other and, while restarts are
    left, `fit()` runs again with the same run name: Ray Train resumes from its committed
    checkpoint, the MLflow run and the tracking actor stay, and the new `fit()` may use only the
    restarts left (`restarts_left`)."""
    run_root = os.path.join(cfg.run.storage_path, cfg.run.name)
    run_id = start_or_resume_run(uri, cfg.tracking.experiment, run_root, cfg.run.name, flatten(to_dict(cfg)))
    tracking = start_tracking_actor(uri, run_id)  # rank 0's MLflow client, across every restart
    logger = RunLogger(uri, run_id)
    started = time.time()
    main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread
    sigterm = _OnSigterm()
    previous = signal.signal(signal.SIGTERM, sigterm) if main else None
    try:
        left = cfg.failure.max_failures
        while True:
            try:
                _torch_trainer(cfg, tracking, run_id, run_root, left).fit()
                break
            except Exception as e:
                if sigterm.signalled or not failed_during_group_start(e) or find_user_error(e):
                    raise
                _record_group_start_failure(logger, e)
                left = restarts_left(logger, started, cfg.failure.max_failures)
                if left < 0:
                    raise
                log.warning("a worker died while the worker group started (%s); resuming, %d restarts left", e, left)
    except BaseException as e:
        close(tracking, timeout_s=2.0 if sigterm.signalled else 60.0)  # queued values before the end time
        if sigterm.signalled:  # a terminal status and an end time; a resubmission sets RUNNING again
            logger.finish("KILLED")
            raise Terminated("stopped by SIGTERM") from None
        if not isinstance(e, Exception):
            raise
        logger.finish("FAILED")  # Ray wraps worker errors (TrainingFailedError / ControllerError)
        user = find_user_error(e)
        raise user or RunFailed(failure_line(cfg, logger, started, describe(e))) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    close(tracking)
    try:
        raise_if_ended(run_root)  # a worker ended the run with an error no restart cures (a full disk)
    except UserError:
        logger.finish("FAILED")
        raise
    logger.finish("FINISHED")
    return run_id


def _record_group_start_failure(logger: RunLogger, e: BaseException) -> None:
    """A `failure` event for a worker lost while the group started, as `RunRecorder` records the
    others (Ray Train calls no user callback for a controller error). `source: group_start`: never
    merged into the failure before it (`raytrain_ft.recovery.failures`). Which rank died is not
    known here."""
    latest = logger.latest_metrics()
    cause = f"a worker died while the worker group started ({plain_cause(e.controller_failure)})"
    logger.tags({"last_failure_cause": cause})
    logger.event(
        "failure",
        source=GROUP_START,
        causes={GROUP_START: cause},
        details={GROUP_START: str(e)[:20000]},
        last_step=int(latest.get("last_step", 0)),
        step_time_s=latest.get("current_step_time_s", 0.0),
        world_size=int(latest.get("world_size", 0)),
    )
