"""The one module that imports Ray Train's private names; everything else uses Ray's public API.

Ray Train 2.60 has no public API for what these serve, so they are named here once, and a Ray
upgrade that moves them breaks this file alone (`tests/unit/test_import_rules.py` keeps every
other module off `ray.*._internal` and the underscored names):

- `ControllerCallback` and the controller's states (`RestartingState`, `ErroredState`,
  `ReschedulingState`): the only hook that sees Ray Train decide on a worker-group failure
  (restart, end the run, or retry a group start), which `launch.callbacks.FailureRecorder`
  records once per decision. The public `UserCallback` sees reports and the final exception only.
- `WorkerGroupStartupFailedError`: the controller error that wraps a worker actor's death during
  the group's setup (`launch.callbacks.lost_in_setup`); Ray exports no name for it.
  `WorkerGroupStartupTimeoutError`: a start that found no resources in time (`launch.callbacks.start_timed_out`).
- `WorkerGroupCallback` and `RunningState`: the hooks around a worker-group start (before its setup,
  at its shutdown or abort) and the state in which the controller holds a started group, which
  `launch.group_start.StartCleaner`, `launch.start_faults` and `launch.callbacks.WatchRanks` use.
- `_TorchBackend`: Ray Train's torch backend, whose process-group setup `launch.start_faults` extends
  to fail a worker inside it (the `kill_in_setup` fault).
- `ReplicaGroup` and `_TorchftBackend`: the backend of the public `TorchftConfig`, extended to tell
  a replacement replica from a whole-group start (`launch.replica_backend`).
- `draining_nodes`: the GCS accessor `ray._private.state.state.get_draining_nodes()` that Ray
  Train's own `PreemptionWatcher` reads, `{node id hex: drain deadline in unix ms, 0 for none}`,
  the state `ray drain-node` sets (`launch.preemption`).
"""

import ray
from ray.train.torch.config import _TorchBackend as TorchBackend
from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError, WorkerGroupStartupTimeoutError
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller.state import (
    ErroredState,
    ReschedulingState,
    RestartingState,
    RunningState,
)
from ray.train.v2._internal.execution.worker_group import ReplicaGroup
from ray.train.v2.torch.torchft_config import _TorchftBackend as TorchftBackend


def draining_nodes() -> dict[str, int]:
    """{node id hex: drain deadline in unix milliseconds (0: none)} of every node being drained."""
    return ray._private.state.state.get_draining_nodes()


__all__ = [
    "draining_nodes",
    "ControllerCallback",
    "ErroredState",
    "ReplicaGroup",
    "ReschedulingState",
    "RestartingState",
    "RunningState",
    "TorchBackend",
    "TorchftBackend",
    "WorkerGroupCallback",
    "WorkerGroupStartupFailedError",
    "WorkerGroupStartupTimeoutError",
]
