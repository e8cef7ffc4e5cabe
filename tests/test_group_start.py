"""A worker lost while Ray Train starts the worker group, after an earlier failure, on a real local Ray.

Ray Train 2.60 ends the run on an `ActorDiedError` raised in its controller's `_start_worker_group`
(a non-retryable controller error) however many restarts are left; the driver resumes instead
(`raytrain_ft.launch.driver.failed_during_group_start`). The kill is placed deterministically by a
Ray Train controller callback (`RAY_TRAIN_CALLBACKS`, Ray's own hook for extra callbacks): at the
second group start, once Ray has launched the train function and before any step, it SIGKILLs rank
1's process and waits on that actor as the controller does, so the controller raises the same
`ActorDiedError` from `_start_worker_group` that a kill from outside raises when it lands there.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import ray
import ray.cloudpickle
from mlflow.tracking import MlflowClient
from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from conftest import assert_resumed, assert_same_state, final_state, make_config
from raytrain_ft.launch.driver import run
from raytrain_ft.recovery import GROUP_START, failures
from raytrain_ft.tracking import MlflowRecorder

pytestmark = pytest.mark.usefixtures("ray_local")
MARKER_ENV = "RAYTRAIN_FT_TEST_KILL_MARKER"  # a file: the kill happened (once per run, across fit() calls)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the controller cannot import this test module


class KillAtSecondGroupStart(WorkerGroupCallback):
    """Controller side: at the run's second worker-group start, after Ray launched the train function, kill rank 1."""

    def __init__(self):
        self.marker, self.starts = os.environ[MARKER_ENV], 0

    def after_worker_group_training_start(self, worker_group) -> None:
        self.starts += 1
        if self.starts < 2 or os.path.exists(self.marker):
            return
        open(self.marker, "w").close()
        worker = worker_group.get_workers()[1]
        os.kill(worker.metadata.pid, signal.SIGKILL)
        ray.get(worker.actor.__ray_ready__.remote())  # ActorDiedError, raised in _start_worker_group


def test_a_worker_lost_while_the_group_restarts_is_survived_and_counted(tmp_path, dataset, reference, monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_CALLBACKS", f"{__name__}.{KillAtSecondGroupStart.__name__}")
    monkeypatch.setenv(MARKER_ENV, str(tmp_path / "killed"))
    faults = "faults=[{kind: kill, step: 7, rank: 1}]"  # the earlier failure: the step-5 save is committed
    cfg = make_config(tmp_path, dataset, "train.max_steps=30", "failure.max_failures=2", faults)
    run_id = run(cfg)
    assert (tmp_path / "killed").exists()
    # the group start killed after the kill at step 7 never reached a step: the next fit() resumed from 5
    assert_resumed(cfg.tracking.uri, run_id, [0, 5])
    (_, kill), (_, group_start) = failures(MlflowRecorder(cfg.tracking.uri, run_id).events())
    assert "killed" in kill["causes"]["1"]
    assert group_start["source"] == GROUP_START and "actor died" in group_start["details"][GROUP_START]
    assert MlflowClient(cfg.tracking.uri).get_run(run_id).data.metrics["restarts"] == 2  # both restarts
    assert_same_state(final_state(cfg, 30), reference[2])
