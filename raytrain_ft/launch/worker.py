"""Ray Train worker entry point: a `Session` backed by Ray Train and Ray Data, then `loop.train`."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import numpy as np
import ray
import ray.train
from ray.train import Checkpoint, CheckpointUploadMode

from raytrain_ft.checkpoint.checkpointer import prune
from raytrain_ft.core.config_files import from_dict
from raytrain_ft.core.run_folder import read_commit_ack, read_latest, step_of, write_latest, write_worker_record
from raytrain_ft.core.waits import wait_for
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.launch.datasource import rank_micro_batches
from raytrain_ft.launch.memory_keeper import RayKeepers
from raytrain_ft.launch.preemption import DrainWatcher
from raytrain_ft.launch.recorder_actor import WAIT_TIMEOUT_S, RemoteRecorder
from raytrain_ft.launch.replica_backend import REPLACEMENT_ENV
from raytrain_ft.resilience.preemption import Notice
from raytrain_ft.resilience.recovery import RunHistory
from raytrain_ft.training import loop

log = logging.getLogger(__name__)


class RaySession:
    """`raytrain_ft.training.session.Session` for a Ray Train worker."""

    def __init__(
        self,
        data_path: str,
        seed: int,
        recorder_actor: ray.actor.ActorHandle,
        mlflow_run_id: str,
        watchdog: ray.actor.ActorHandle,
        commit_timeout_s: float = 60.0,
    ):
        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.node = ray.get_runtime_context().get_node_id()
        self.replacement = os.environ.get(REPLACEMENT_ENV) == "1"  # set by `driver.ReplicaBackend`
        storage = ctx.get_storage()
        self.filesystem = storage.storage_filesystem  # pyarrow's: Ray compares it when registering a checkpoint
        scheme = self.filesystem.type_name
        path = storage.experiment_fs_path
        self.run_root = path if scheme == "local" else f"{scheme}://{path}"  # fsspec URL for DCP and our files
        write_worker_record(
            self.run_root, self.rank, ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()
        )
        self.data_path, self.seed = data_path, seed
        self.recorder_actor, self.mlflow_run_id, self.watchdog = recorder_actor, mlflow_run_id, watchdog
        self.manifest = load_manifest(data_path)
        self.last_commit: str | None = None
        self.commit_timeout_s = commit_timeout_s
        # every worker of a drained node records its preemption (its rank in the event): Ray Train's
        # local rank counts workers per node IP, which several nodes share on one machine (`Cluster`)
        self.drain = DrainWatcher(ray.get_runtime_context().get_node_id(), records=True)

    def recorder(self, attempt: bool) -> RemoteRecorder:
        if attempt:
            self.recorder_actor.new_attempt.remote()
        return RemoteRecorder(self.recorder_actor)

    def history(self) -> RunHistory:
        return ray.get(self.recorder_actor.history.remote(), timeout=WAIT_TIMEOUT_S)

    def latest_checkpoint(self) -> str | None:
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        scheme = checkpoint.filesystem.type_name
        return checkpoint.path if scheme == "local" else f"{scheme}://{checkpoint.path}"

    def memory_keepers(self, memory_dir: str) -> RayKeepers:
        return RayKeepers(memory_dir, self.mlflow_run_id, self.commit_timeout_s)

    def commit(self, step: int, path: str, metrics: dict[str, float]) -> None:
        # The DCP files already live in the experiment folder: register them without a copy.
        self.last_commit = path
        ray.train.report(
            metrics,
            checkpoint=Checkpoint(path.split("://", 1)[-1], filesystem=self.filesystem),
            checkpoint_dir_name=path.rstrip("/").rsplit("/", 1)[-1],
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )

    def flush(self) -> None:
        """Raises `WaitTimeoutError` when Ray Train has not registered the last commit within
        `waits.commit_timeout_s` (the controller callback acknowledges each one in a file): the
        attempt fails and the restart resumes from the last checkpoint Ray registered."""
        if self.last_commit is None:
            return
        expected = self.last_commit.split("://", 1)[-1]  # Ray records paths without the scheme
        wait_for(
            lambda: (read_commit_ack(self.run_root) or "").split("://", 1)[-1] == expected,
            self.commit_timeout_s,
            f"rank {self.rank}: Ray Train's registration of {self.last_commit}",
            "waits.commit_timeout_s",
        )

    def beat(self, step: int) -> None:
        self.watchdog.beat.remote(self.rank, step)  # `launch.progress_watchdog.ProgressWatchdog`; not waited for

    def preemption_notice(self) -> Notice | None:
        return self.drain.notice()

    def micro_batches(
        self, epoch: int, start: int, stop: int, plan: BatchPlan, rank: int
    ) -> Iterator[dict[str, np.ndarray]]:
        return rank_micro_batches(self.data_path, self.manifest, self.seed, epoch, start, stop, plan, rank)


class ReplicaSession(RaySession):
    """`Session` of one replica under `failure.recovery: replica` (`raytrain_ft.resilience.replicas`): nothing
    here waits on another Ray Train worker. `ray.train.report` and `get_preemption_info` are
    barriers over every worker, and a survivor blocked in one while its replacement waits in the
    torchft quorum deadlocks. So the replica that wrote a checkpoint (the step's participant of rank
    0, alone) commits it in `<run folder>/latest_checkpoint` (`run_folder.write_latest`:
    renamed into place whole) and prunes older ones to `checkpoint.num_to_keep` (`checkpoint.prune`);
    a restart of every replica resumes from it (Ray Train's `get_checkpoint()` holds none in this
    mode)."""

    def __init__(self, cfg, recorder_actor: ray.actor.ActorHandle, mlflow_run_id: str, watchdog: ray.actor.ActorHandle):
        super().__init__(
            cfg.data.path, cfg.train.seed, recorder_actor, mlflow_run_id, watchdog, cfg.waits.commit_timeout_s
        )
        self.keep = cfg.checkpoint.num_to_keep

    def latest_checkpoint(self) -> str | None:
        return read_latest(self.run_root)

    def commit(self, step: int, path: str, metrics: dict[str, float]) -> None:
        current = read_latest(self.run_root)
        if current is not None and step_of(current) >= step:  # another replica committed a newer one meanwhile
            return
        write_latest(self.run_root, path)
        prune(self.run_root, step, self.keep)

    def flush(self) -> None:
        pass  # `commit` is done when it returns


def train_func(args: dict) -> None:
    """`train_loop_per_worker` of the `TorchTrainer` (args: config dict, `RecorderActor`, MLflow run id,
    `ProgressWatchdog`)."""
    cfg = from_dict(args["config"])
    actors = args["recorder_actor"], args["mlflow_run_id"], args["watchdog"]
    if cfg.failure.recovery == "replica":
        session: RaySession = ReplicaSession(cfg, *actors)
    else:
        session = RaySession(cfg.data.path, cfg.train.seed, *actors, cfg.waits.commit_timeout_s)
    loop.train(cfg, session)
