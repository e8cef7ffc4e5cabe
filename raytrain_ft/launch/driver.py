"""Driver side: validate up front, create/reuse the MLflow run, build and fit the `TorchTrainer`."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.train import CheckpointConfig, ControllerError, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain_ft.core.config import Config
from raytrain_ft.core.config_files import to_dict
from raytrain_ft.core.errors import UserError, find_user_error
from raytrain_ft.core.run_folder import read_exclusions, run_root
from raytrain_ft.core.waits import HEALTH_CHECK_INTERVAL_S
from raytrain_ft.launch import memory_keeper, progress_watchdog
from raytrain_ft.launch.callbacks import CommitAcknowledger, FailureRecorder, WatchRanks, describe, plain_cause
from raytrain_ft.launch.group_start import START_TIMEOUT_ENV, StartCleaner, baseline_resources
from raytrain_ft.launch.progress_watchdog import start_watchdog
from raytrain_ft.launch.recorder_actor import RemoteRecorder, close, start_recorder_actor
from raytrain_ft.launch.start_faults import StartFaultConfig, StartFaults
from raytrain_ft.launch.tracking_server import lasting_path, tracking_credentials, tracking_store
from raytrain_ft.launch.worker import train_func
from raytrain_ft.resilience.recovery import GROUP_START, cause_text, failures, root_first, who
from raytrain_ft.resilience.replicas import LIGHTHOUSE
from raytrain_ft.telemetry.tracking import MlflowRecorder, finish_run, flatten, resolve_uri, start_or_resume_run
from raytrain_ft.training.preflight import problems

log = logging.getLogger(__name__)

# Propagated to every Ray Train worker and the controller (runtime_env).
WORKER_ENV = {
    # default 2 s: reports and failures noticed sooner (`waits.HEALTH_CHECK_INTERVAL_S`, what preflight checks with)
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": str(HEALTH_CHECK_INTERVAL_S),
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",  # worker prints appear once
    # A failed or timed-out NCCL collective aborts its communicators and tears the process down, so
    # Ray Train sees a dead worker and restarts the group. The timeout is the process group's
    # (TorchConfig(timeout_s=failure.collective_timeout_s)); PyTorch does not read NCCL_TIMEOUT.
    # TORCH_NCCL_BLOCKING_WAIT stays unset: it makes every wait() block the host thread (Ray Train
    # leaves it unset for its overhead too), and this watchdog already turns a stuck collective into an
    # error. The same setting in cluster.yaml and cluster-gcp.yaml and in docs/cluster.md
    # (tests/test_docs.py checks that they agree).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


def job_runtime_env() -> dict[str, dict[str, str]]:
    """The runtime env a job's `ray.init` gives every task and actor it starts (the Train controller,
    its workers, the recorder and keeper actors): `WORKER_ENV` and the MLflow credentials
    (`tracking_server.tracking_credentials`: the environment's, else new ones the job's own tracking
    server will admit). Ray merges it into each task's and actor's own `env_vars`."""
    return {"env_vars": {**WORKER_ENV, **tracking_credentials()}}


class RunFailed(UserError):
    """The run used up `failure.max_failures` restarts."""


class Terminated(BaseException):
    """SIGTERM reached the driver (`ray job stop`, the head being preempted)."""


class _OnSigterm:
    """SIGTERM handler: remembers the signal, aborts the Train controller and interrupts `fit()`.

    `fit()` waits in `ray.get` on the controller, and an exception raised by a Python signal handler
    there does not end that wait: Ray reports it (wrapped, e.g. as a SystemError, so the driver checks
    `signalled`) only once the `ray.get` returns, and the workers trained on until the run's end or
    the job supervisor's SIGKILL (measured: a handler run 2 s into a 15 s `ray.get` surfaced at 12 s).
    So the handler first runs the SIGINT handler Ray Train's `fit()` installed, its graceful abort for
    Ctrl-C (`controller.abort`): the controller stops the worker group and `fit()` returns within
    seconds. Outside `fit()` (no Ray Train handler installed) it only raises."""

    signalled = False

    def __call__(self, signum: int, frame) -> None:
        self.signalled = True
        abort = signal.getsignal(signal.SIGINT)
        if callable(abort) and abort is not signal.default_int_handler:
            abort(signal.SIGINT, frame)
        raise Terminated("stopped by SIGTERM")


def cluster_resources(address: str) -> dict[str, float]:
    """The resources (`ray.cluster_resources()`: "CPU", "GPU", ... -> amount) of the running cluster at
    `address`; connects as a driver and disconnects, never starts a cluster (`raytrain-ft check --address`)."""
    ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        return ray.cluster_resources()
    finally:
        ray.shutdown()


def preflight(cfg: Config) -> None:
    """Catch user errors before any worker starts (`raytrain_ft.training.preflight.problems`, the function
    `raytrain-ft check` runs): raises the first problem found, a one-line `UserError`."""
    found = problems(cfg, ray.cluster_resources())
    if found:
        raise found[0]


MAX_LINE = 300


def failure_line(cfg: Config, recorder: MlflowRecorder, started: float, fallback: str) -> str:
    """The job's last line when the run used up `failure.max_failures` (under `MAX_LINE` characters):
    run name, restarts used, the root-cause rank, its last completed step, the plain cause
    (`callbacks.plain_cause`), and the command that shows the whole history. `started`: when this
    submission's `fit()` began (unix seconds; earlier submissions' failures are not counted)."""
    try:
        these = [f for _, f in failures(recorder.events()) if f["time"] >= started]
    except Exception:  # the tracking store is unreachable: say what Ray said
        these = []
    uri = resolve_uri(cfg.tracking.uri)  # the store's own URI, not the embedded server's (gone after the job)
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


def _torch_trainer(
    cfg: Config,
    recorder_actor,
    watchdog,
    run_id: str,
    run_root: str,
    max_failures: int,
    baseline: dict[str, float],
    excluded: list[str],
) -> TorchTrainer:
    """`excluded`: Ray node ids the worker group must not use (`without_nodes`)."""
    lo, hi = cfg.worker_range
    resources = {"CPU": cfg.scaling.cpus_per_worker, **({"GPU": 1} if cfg.scaling.use_gpu else {})}
    num_workers, label_selector = without_nodes(lo, hi, resources, excluded, ray.nodes())
    replicas = hi if cfg.failure.recovery == "replica" else 0  # FailureRecorder: a partial failure is a replacement
    callbacks: list[Any] = [  # Ray Train v2's callback classes; mypy reads v1's `Callback`
        CommitAcknowledger(run_root),
        FailureRecorder(recorder_actor, replicas, watchdog),
        WatchRanks(watchdog),
        StartCleaner(recorder_actor, baseline),
        *([StartFaults(cfg.faults, run_root)] if any(f.kind == "kill_at_launch" for f in cfg.faults) else []),
    ]
    return TorchTrainer(
        train_func,
        train_loop_config={
            "config": to_dict(cfg),
            "recorder_actor": recorder_actor,
            "mlflow_run_id": run_id,
            "watchdog": watchdog,
        },
        # mypy reads ray.train's Ray Train v1 names; v2 (the default, which this needs) exports its own
        scaling_config=ScalingConfig(  # type: ignore[call-arg]
            num_workers=num_workers,  # type: ignore[arg-type]
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker=resources,
            label_selector=label_selector,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_check_interval_s,
        ),
        torch_config=torch_config(cfg, run_root),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=cfg.run.storage_path,
            # a start that found no resources within failure.group_start_timeout_s is a controller failure
            # to Ray Train (unlimited by default): bounded by the same number of restarts
            failure_config=FailureConfig(max_failures=max_failures, controller_failure_limit=max_failures),  # type: ignore[call-arg]
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
            callbacks=callbacks,
        ),
    )


def without_nodes(
    lo: int, hi: int, per_worker: dict[str, float], excluded: list[str], nodes: list[dict]
) -> tuple[int | tuple[int, int], dict[str, str] | None]:
    """`ScalingConfig`'s `num_workers` and `label_selector` for a worker group kept off the
    `excluded` node ids (stragglers, `straggler.action: exclude`), from `ray.nodes()`' records
    (`NodeID`, `Alive`, `Resources`): every node carries Ray's label `ray.io/node-id`, and the
    selector `!in(...)` of the excluded ones keeps the group's placement group off them. Ray Train's
    elastic policy counts every alive node's resources (it reads no label), so the range's maximum
    loses the workers the excluded alive nodes hold (`per_worker`: one worker's resources), never
    below the minimum: if the other nodes cannot hold the minimum the group start waits for a node,
    bounded by `failure.group_start_timeout_s` and the restarts left."""
    if not excluded:
        return (lo if lo == hi else (lo, hi)), None
    held = 0
    for node in nodes:
        if node["NodeID"] in excluded and node["Alive"]:
            have = node["Resources"]
            held += int(min(have.get(k, 0.0) // v for k, v in per_worker.items() if v > 0))
    hi = max(hi - held, lo)
    return (lo if lo == hi else (lo, hi)), {"ray.io/node-id": f"!in({','.join(excluded)})"}


def torch_config(cfg: Config, run_root: str) -> TorchConfig:
    """Ray Train's torch backend: one process group of every worker, or under `failure.recovery:
    replica` one per replica group (one worker each) and a torchft lighthouse (`raytrain_ft.resilience.replicas`),
    which marks a replacement replica (`launch.replica_backend`). With `kill_in_setup` faults (restart
    mode) the backend fires them (`launch.start_faults`) for the run in `run_root`."""
    backend, timeout_s = "nccl" if cfg.scaling.use_gpu else "gloo", cfg.failure.collective_timeout_s
    if cfg.failure.recovery == "replica":
        from raytrain_ft.launch.replica_backend import ReplicaConfig

        return ReplicaConfig(lighthouse_kwargs=LIGHTHOUSE, backend=backend, timeout_s=timeout_s)
    if any(f.kind == "kill_in_setup" for f in cfg.faults):
        return StartFaultConfig(backend=backend, timeout_s=timeout_s, faults=cfg.faults, run_root=run_root)
    return TorchConfig(backend=backend, timeout_s=timeout_s)


def failed_during_group_start(e: BaseException) -> bool:
    """Whether `fit()` ended on a worker that died while Ray Train started the worker group.

    Ray Train 2.60 retries a controller error only when it wraps `WorkerGroupStartupFailedError`
    or `WorkerGroupStartupTimeoutError` (`ray/train/v2/_internal/execution/failure_handling/default.py`);
    a worker actor that dies after the group's setup, while the controller launches the train
    function (`WorkerGroup._start_impl`), raises `ActorDiedError` there unwrapped, and the failure
    policy ends the run however many restarts are left. One that dies earlier, during the setup, ends
    it the same way (`callbacks.FailureRecorder`)."""
    return isinstance(e, ControllerError) and isinstance(e.controller_failure, RayActorError)


def restarts_left(recorder: MlflowRecorder, started: float, max_failures: int) -> int:
    """`failure.max_failures` minus the failures of this submission (since unix time `started`), each of
    which was (or is about to be) followed by a restart: what the next `fit()` may still use; negative
    when the limit is used up. Counted from the run's `failure` events, as the failure line and the
    recovery history count them."""
    return max_failures - len([f for _, f in failures(recorder.events()) if f["time"] >= started])


def _fit(cfg: Config, uri: str) -> str:
    """Fit until the run finishes. A worker lost while Ray Train starts the group
    (`failed_during_group_start`) is recorded as a failure like any other and, while restarts are
    left, `fit()` runs again with the same run name: Ray Train resumes from its committed
    checkpoint, the MLflow run and the recorder actor stay, and the new `fit()` may use only the
    restarts left (`restarts_left`). A `fit()` that returned because stragglers were excluded
    (`straggler.action: exclude` under restart recovery: the workers saved the step, waited for its
    registration and returned; `run_folder.read_exclusions`) runs again the same way, its worker group
    kept off every node excluded in this submission (`without_nodes`); an exclusion is no failure
    and uses no restart. A resubmission lets the nodes in again (docs/stragglers.md)."""
    root = run_root(cfg.run.storage_path, cfg.run.name)
    run_id = start_or_resume_run(uri, cfg.tracking.experiment, root, cfg.run.name, flatten(to_dict(cfg)))
    # rank 0's MLflow client, across every restart
    recorder_actor = start_recorder_actor(uri, run_id, cfg.waits.tracking_timeout_s)
    f = cfg.failure  # the driver's progress watchdog, across every restart (`launch.progress_watchdog`)
    watchdog = start_watchdog(
        root, recorder_actor, f.hang_timeout_s, f.start_timeout_s, cfg.train.max_steps, f.liveness_timeout_s
    )
    recorder = MlflowRecorder(uri, run_id)  # the driver's own: the run's status, the failure line
    started = time.time()
    baseline = baseline_resources()  # what every attempt must leave free (launch.group_start)
    os.environ[START_TIMEOUT_ENV] = f"{cfg.failure.group_start_timeout_s:g}"  # Ray Train passes it to its controller
    main = threading.current_thread() is threading.main_thread()  # signal handlers live in the main thread
    sigterm = _OnSigterm()
    previous = signal.signal(signal.SIGTERM, sigterm) if main else None
    try:
        left = cfg.failure.max_failures
        excluded: list[str] = []  # stragglers' nodes, kept out for the rest of this submission
        while True:
            try:
                _torch_trainer(cfg, recorder_actor, watchdog, run_id, root, left, baseline, excluded).fit()
                new = [r for r in read_exclusions(root, since=started) if r["node"] not in excluded]
                if not new or cfg.failure.recovery == "replica":  # replicas: Ray Train replaced them
                    break
                excluded += sorted({r["node"] for r in new})
                log.warning(
                    "stragglers excluded after step %d (nodes %s); resuming without them", new[-1]["step"], excluded
                )
            except Exception as e:
                if sigterm.signalled or not failed_during_group_start(e) or find_user_error(e):
                    raise
                # through the actor: in the run history the next attempt plans with
                stopped = progress_watchdog.stopped_causes(watchdog)  # a frozen rank the watchdog stopped
                _record_group_start_failure(RemoteRecorder(recorder_actor, wait=True), e, stopped)
                ray.get(recorder_actor.drain.remote(cfg.waits.tracking_timeout_s))  # the event is read back next
                left = restarts_left(recorder, started, cfg.failure.max_failures)
                if left < 0:
                    raise
                log.warning("a worker died while the worker group started (%s); resuming, %d restarts left", e, left)
    except BaseException as e:
        progress_watchdog.close(watchdog)
        close(recorder_actor, timeout_s=2.0 if sigterm.signalled else 60.0)  # queued values before the end time
        if sigterm.signalled:  # a terminal status and an end time; a resubmission sets RUNNING again
            recorder.finish("KILLED")
            raise Terminated("stopped by SIGTERM") from None
        if not isinstance(e, Exception):
            raise
        finish_run(recorder, root, failed=True)  # Ray wraps worker errors (TrainingFailedError / ControllerError)
        user = find_user_error(e)
        raise user or RunFailed(failure_line(cfg, recorder, started, describe(e))) from None
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    progress_watchdog.close(watchdog)
    close(recorder_actor)
    finish_run(recorder, root, failed=False)  # raises the error a worker ended the run with (a full disk)
    if cfg.checkpoint.memory.enabled:
        memory_keeper.drop_run(cfg.checkpoint.memory.dir, run_id)
    return run_id


def _record_group_start_failure(recorder: RemoteRecorder, e: BaseException, stopped: dict[int, str]) -> None:
    """A `failure` event for a worker lost while the group started, as `FailureRecorder` records the
    others (it records only worker-group failures: a controller error is not one). `source: group_start`.
    Which rank died is known only when the progress watchdog stopped it (`stopped`: {rank: cause},
    a rank frozen in Ray Train's setup, past `failure.start_timeout_s`): then its cause is the stall."""
    latest = recorder.latest_metrics()
    died = f"a worker died while the worker group started ({plain_cause(getattr(e, 'controller_failure', e))})"
    causes = {str(r): f"while the worker group started: {c}" for r, c in sorted(stopped.items())} or {GROUP_START: died}
    recorder.tags({"last_failure_cause": cause_text(causes) if stopped else died})
    recorder.event(
        "failure",
        source=GROUP_START,
        causes=causes,
        details={GROUP_START: str(e)[:20000]},
        last_step=int(latest.get("last_step", 0)),
        step_time_s=latest.get("current_step_time_s", 0.0),
        world_size=int(latest.get("world_size", 0)),
    )
