"""Failures that cluster around worker-group starts, at exact fit, on a real local Ray.

The cluster has exactly one worker group's CPUs (2 workers x half of the session cluster's CPUs), so
a placement group left behind by one start leaves the next start nothing to place: in Ray Train 2.60
a worker lost after the group's state was built and before `WorkerGroup.create` returned leaves a
half-started group nobody removes (`raytrain_ft.launch.group_start`). Four failures in a row, each at
another moment, the last three at starts that resume from step 5 (`raytrain_ft.resilience.faults`):

1. rank 1 killed at step 7 (the step-5 save is committed): Ray Train restarts the group;
2. rank 1 killed in the process-group setup of that restart (`kill_in_setup`): the driver resumes
   (`driver.failed_during_group_start`);
3. rank 0 killed once Ray launched the train function (`kill_at_launch`): the driver resumes again;
4. rank 1 killed before the first step of the next attempt (`kill_at_first_step`): Ray restarts.

Every start records the cluster's free resources (`group_start` event): each equals what the job
started with, and no placement group is alive, however the previous attempt ended.
"""

from __future__ import annotations

import pytest
import ray
from mlflow.tracking import MlflowClient

from conftest import assert_resumed, assert_same_state, events, final_state, make_config
from raytrain_ft.launch.driver import run
from raytrain_ft.resilience.recovery import GROUP_START, failures
from raytrain_ft.telemetry.tracking import MlflowRecorder

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.exclusive]

FAULTS = (
    "faults=[{kind: kill, step: 7, rank: 1}, {kind: kill_in_setup, step: 5, rank: 1},"
    " {kind: kill_at_launch, step: 5, rank: 0}, {kind: kill_at_first_step, step: 5, rank: 1}]"
)


def alive_placement_groups() -> list[str]:
    return [pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]


# A leftover placement group makes every later start wait for resources: up to 60 s per start, then a counted
# failure, until the restarts are used up (the run fails inside the timeout instead of hanging)
@pytest.mark.timeout(600)
def test_failures_clustered_around_group_starts_at_exact_fit_leave_nothing_behind(tmp_path, dataset, reference):
    free = ray.available_resources()["CPU"]
    assert not alive_placement_groups()
    cfg = make_config(
        tmp_path,
        dataset,
        "train.max_steps=30",
        "failure.max_failures=4",
        "failure.group_start_timeout_s=30",
        f"scaling.cpus_per_worker={free / 2}",  # exact fit: the two workers take every CPU
        FAULTS,
    )
    run_id = run(cfg)
    uri = cfg.tracking.uri

    # attempts that reached the loop: the start, the restart killed at its first step, the last one
    assert_resumed(uri, run_id, [0, 5, 5])
    kill, setup, launch, first_step = (f for _, f in failures(MlflowRecorder(uri, run_id).events()))
    assert "killed" in kill["causes"]["1"] and "killed" in first_step["causes"]["1"]
    for lost in (setup, launch):
        assert lost["source"] == GROUP_START and "actor died" in lost["details"][GROUP_START]
    assert MlflowClient(uri).get_run(run_id).data.metrics["restarts"] == 4

    # five group starts (two fit() calls after the two lost starts): each found the job's free resources
    starts = events(uri, run_id, "group_start")
    assert len(starts) == 5
    for start in starts:
        assert start["free"] == start["baseline"] == {"CPU": free}, starts
        assert start["placement_groups"] == [], starts
    assert not alive_placement_groups()  # nor did the run leave any behind

    assert_same_state(final_state(cfg, 30), reference[2])
