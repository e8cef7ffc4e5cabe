"""The `device` fault (a simulated accelerator for benchmarks/stragglers.py): its wait per step as a
pure value (`FaultInjector.wait_s`), and its config check. No process group."""

from __future__ import annotations

import pytest

from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.core.fault_spec import FaultSpec
from raytrain_ft.resilience.faults import FaultInjector


def injector(rank: int, *faults: FaultSpec) -> FaultInjector:
    return FaultInjector(list(faults), rank, "", settle=lambda: None, par=None)  # type: ignore[arg-type]


DEVICE = FaultSpec(kind="device", step=1, rank=-1, steps=100, seconds=0.01, jitter=0.2)


def test_the_wait_is_per_sequence_jittered_within_bounds_and_the_same_for_the_same_step_and_rank():
    waits = [injector(0, DEVICE).wait_s(s, 0.0, 3, 2) for s in range(1, 101)]
    assert all(0.03 * 0.8 <= w <= 0.03 * 1.2 for w in waits)
    assert max(waits) - min(waits) > 0.03 * 0.3  # jittered, not constant
    assert waits == [injector(0, DEVICE).wait_s(s, 0.0, 3, 2) for s in range(1, 101)]  # reproducible
    assert waits != [injector(1, DEVICE).wait_s(s, 0.0, 3, 2) for s in range(1, 101)]  # each rank its own draw
    assert injector(0, DEVICE).wait_s(101, 0.0, 3, 2) == 0.0  # after its steps


def test_a_slow_fault_scales_the_device_wait_as_the_ranks_own_compute():
    steady = FaultSpec(kind="device", step=1, rank=-1, steps=100, seconds=0.01)
    slow = FaultSpec(kind="slow", step=2, rank=1, steps=100, factor=3.0)
    rank1 = injector(1, steady, slow)
    first = rank1.wait_s(1, 0.0, 4, 2)  # 0.04 s of device time; no slow yet
    assert first == pytest.approx(0.04)
    # the next step's slow wait: (3 - 1) x the previous step's compute (its device wait included)
    assert rank1.wait_s(2, first, 4, 2) == pytest.approx(0.04 + 2 * 0.04)
    assert injector(0, steady, slow).wait_s(2, first, 4, 2) == pytest.approx(0.04)  # rank 0 is not slow


def test_a_slow_fault_until_members_slows_only_the_steps_with_fewer_members():
    # a survivor slowed while it trains alone (1 member), at full speed once its replacement joined (2)
    alone = FaultSpec(kind="slow", step=6, rank=0, steps=30, seconds=4.0, until_members=2)
    rank0 = injector(0, alone)
    assert [rank0.wait_s(s, 0.1, 8, 1) for s in (5, 6, 35, 36)] == [0.0, 4.0, 4.0, 0.0]
    assert rank0.wait_s(7, 0.1, 4, 2) == 0.0


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("{kind: device, step: 1, seconds: 0.0}", "'faults[0].seconds' (0) and 'faults[0].jitter' (0)"),
        ("{kind: device, step: 1, seconds: 0.1, jitter: 1.0}", "'faults[0].seconds' (0.1) and 'faults[0].jitter' (1)"),
    ],
)
def test_a_device_fault_without_a_wait_or_with_jitter_of_1_is_one_line(fault, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"faults=[{fault}]"])
    assert (
        str(e.value)
        == f"config keys {message} of a device fault need seconds > 0 (the wait per sequence) and 0 <= jitter < 1"
    )
