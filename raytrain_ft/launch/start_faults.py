"""The group-start faults that fire on the controller (`raytrain_ft.resilience.faults`): `kill_in_setup` and
`kill_at_launch`, for tests and demos of failures that cluster around a worker-group start.

`kill_in_setup` fires inside Ray Train's backend setup: `StartFaultConfig`'s backend sets up the
process group (`TorchConfig`'s own `on_start`, whose rank 0 logs "Setting up process group"), then
SIGKILLs the rank and waits on it, so Ray Train sees the actor die while its setup callbacks run
(`WorkerGroupStartupFailedError`), after it built the group's state. `kill_at_launch` fires in
`StartFaults.after_worker_group_training_start`, once Ray launched the train function on every
worker: the controller sees `ActorDiedError` before `WorkerGroup.create` returns. Both moments leave
a half-started group behind in Ray Train 2.60 (`launch.group_start`). A fault fires at the first start
that resumes from its `step` or later (the step of the checkpoint Ray last registered,
`run_folder.read_commit_ack`), once per run (its marker in `<run folder>/faults/`).
"""

from __future__ import annotations

import dataclasses
import os
import signal

import ray
from ray.train.torch import TorchConfig

from raytrain_ft.core.fault_spec import FaultSpec
from raytrain_ft.core.run_folder import read_commit_ack, step_of
from raytrain_ft.launch.ray_internals import TorchBackend, WorkerGroupCallback
from raytrain_ft.resilience.faults import mark, start_faults_due


def _die() -> None:
    """Run in a worker: SIGKILL its own process."""
    os.kill(os.getpid(), signal.SIGKILL)


def fire(worker_group, faults: list[FaultSpec], run_root: str, kind: str) -> None:
    """Fire the `kind` fault due at this start: mark it, SIGKILL its rank(s) and wait on them, which
    raises Ray's `RayActorError` here, in the controller's start, as a death from outside would."""
    ack = read_commit_ack(run_root)
    for i, f in start_faults_due(list(enumerate(faults)), kind, step_of(ack) if ack else 0, run_root):
        mark(run_root, i, f.step)
        ranks = range(len(worker_group)) if f.rank == -1 else [f.rank]
        ray.get([worker_group.execute_single_async(rank, _die) for rank in ranks])


class _StartFaultBackend(TorchBackend):
    def on_start(self, worker_group, backend_config) -> None:
        super().on_start(worker_group, backend_config)
        fire(worker_group, backend_config.faults, backend_config.run_root, "kill_in_setup")


@dataclasses.dataclass
class StartFaultConfig(TorchConfig):
    """`TorchConfig` whose backend fires `kill_in_setup` faults (`faults`, of the run in `run_root`)."""

    faults: list[FaultSpec] = dataclasses.field(default_factory=list)
    run_root: str = ""

    @property
    def backend_cls(self):
        return _StartFaultBackend


class StartFaults(WorkerGroupCallback):
    """Runs on the controller: fires `kill_at_launch` faults (`faults`, of the run in `run_root`)."""

    def __init__(self, faults: list[FaultSpec], run_root: str):
        self.faults, self.run_root = faults, run_root

    def after_worker_group_training_start(self, worker_group) -> None:
        fire(worker_group, self.faults, self.run_root, "kill_at_launch")
