"""When the group-start faults fire (`raytrain_ft.resilience.faults.start_faults_due`): no Ray, the markers only."""

from __future__ import annotations

from raytrain_ft.core.fault_spec import FaultSpec
from raytrain_ft.resilience.faults import mark, start_faults_due

FAULTS = list(
    enumerate(
        [
            FaultSpec(kind="kill", step=7, rank=1),
            FaultSpec(kind="kill_in_setup", step=5, rank=1),
            FaultSpec(kind="kill_in_setup", step=5, rank=0),
            FaultSpec(kind="kill_at_launch", step=10, rank=0),
        ]
    )
)


def test_a_start_fault_fires_once_at_the_first_start_resuming_from_its_step_or_later_one_per_start(tmp_path):
    root = str(tmp_path)
    assert start_faults_due(FAULTS, "kill_in_setup", 0, root) == []  # the run's first start: nothing committed
    [(first, _)] = start_faults_due(FAULTS, "kill_in_setup", 5, root)
    assert first == 1
    mark(root, first, 5)
    assert start_faults_due(FAULTS, "kill_in_setup", 5, root) == [FAULTS[2]]  # the next start: the next one
    mark(root, 2, 5)
    assert start_faults_due(FAULTS, "kill_in_setup", 20, root) == []  # each once per run
    assert start_faults_due(FAULTS, "kill_at_launch", 5, root) == []
    assert start_faults_due(FAULTS, "kill_at_launch", 10, root) == [FAULTS[3]]
