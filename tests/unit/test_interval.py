"""Checkpoint-interval planner (Young 1974, Daly 2006) and `raytrain-ft plan-interval`. Fast, no Ray."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raytrain_ft.checkpoint.interval import (
    CheckpointSchedule,
    cluster_mtbf_s,
    daly_interval_s,
    expected_waste_fraction,
    interval_steps,
    optimal_interval_s,
    planning_mtbf_s,
    simulate_waste,
    young_interval_s,
)
from raytrain_ft.cli import main

COST_S = 300.0  # a 5-minute checkpoint (docs/restart-recovery.md)
MTBF_S = 36_000.0  # 10,000 h per GPU / 1,000 GPUs = 10 h
WORK_S = 30 * 86_400.0  # a month of useful compute
SEEDS = range(50)


def mean_simulated_waste(interval_s: float, restart_s: float = 0.0) -> float:
    """Mean over fixed seeds; the same seeds for every interval (common random numbers)."""
    return float(np.mean([simulate_waste(interval_s, COST_S, MTBF_S, WORK_S, restart_s, seed=s) for s in SEEDS]))


def test_seed_example_design_notes():
    assert cluster_mtbf_s(10_000, 1_000) == MTBF_S
    assert young_interval_s(300, cluster_mtbf_s(10_000, 1_000)) / 60 == pytest.approx(77.46, abs=0.05)


def test_daly_below_young_and_converges_to_it():
    # The seed example: Daly 4,449.7 s (74.16 min) against Young 4,647.6 s (77.46 min).
    assert daly_interval_s(COST_S, MTBF_S) == pytest.approx(4449.73, abs=0.05)
    assert optimal_interval_s(COST_S, MTBF_S) == daly_interval_s(COST_S, MTBF_S)
    ratios = []
    for cost in (3600.0, 300.0, 30.0, 3.0, 0.3):
        young, daly = young_interval_s(cost, MTBF_S), daly_interval_s(cost, MTBF_S)
        assert daly < young
        ratios.append(daly / young)
    assert ratios == sorted(ratios)  # closer to Young as cost / MTBF shrinks
    assert ratios[0] == pytest.approx(0.8565, abs=1e-4)  # cost / MTBF = 0.1
    assert ratios[1] == pytest.approx(0.9574, abs=1e-4)  # cost / MTBF = 0.0083
    assert ratios[-1] == pytest.approx(0.9986, abs=1e-4)  # cost / MTBF = 8.3e-6: 1 - ratio ~ sqrt(C / 2M)
    assert daly_interval_s(2 * MTBF_S, MTBF_S) == MTBF_S  # Daly: tau = M once C >= 2M


def test_daly_interval_is_near_best_simulated():
    grid = np.linspace(10 * 60, 300 * 60, 20)
    wastes = [mean_simulated_waste(t) for t in grid]
    best = min(wastes)
    assert 60 * 60 < grid[int(np.argmin(wastes))] < 90 * 60  # the simulated optimum is near 74 min
    assert mean_simulated_waste(daly_interval_s(COST_S, MTBF_S)) <= 1.10 * best
    # Far from the optimum is clearly worse: 10 minutes wastes a third of the run in checkpoints.
    assert wastes[0] > 2 * best and wastes[-1] > 1.5 * best


@pytest.mark.parametrize("restart_s", [0.0, 600.0])
def test_first_order_waste_matches_simulation_at_optimum(restart_s):
    tau = daly_interval_s(COST_S, MTBF_S)
    simulated = mean_simulated_waste(tau, restart_s)
    expected = expected_waste_fraction(tau, COST_S, MTBF_S, restart_s)
    # Exact expectation for exponential failures: wall per period M exp(R/M) (exp((tau + C)/M) - 1).
    exact = 1 - tau / (MTBF_S * math.exp(restart_s / MTBF_S) * math.expm1((tau + COST_S) / MTBF_S))
    assert simulated == pytest.approx(exact, abs=0.005)
    assert abs(expected - simulated) < 0.02


def test_waste_and_steps_edges():
    assert expected_waste_fraction(1.0, 1e6, MTBF_S) == 1.0  # clamped
    assert simulate_waste(600, COST_S, 1e12, 6000) == pytest.approx(1 - 6000 / 9000)  # no failures: 10 checkpoints
    assert interval_steps(4449.7, 2.5) == 1780
    assert interval_steps(10.0, 60.0) == 1
    assert interval_steps(10.0, 60.0, min_steps=5) == 5
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            young_interval_s(bad, MTBF_S)
        with pytest.raises(ValueError):
            daly_interval_s(COST_S, bad)
    with pytest.raises(ValueError):
        cluster_mtbf_s(10_000, 0)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`raytrain-ft ARGS` in this process (no subprocess in the unit tier): exit status, stdout, stderr."""
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_plan_interval_seed_example(capsys):
    rc, out, err = run_cli(
        capsys, "plan-interval", "--mtbf-hours", "10000", "--gpus", "1000", "--checkpoint-seconds", "300"
    )
    assert rc == 0, err
    assert "77.5" in out  # Young, minutes
    assert "10.0" in out  # cluster MTBF, hours
    assert "74.2" in out  # Daly, minutes
    assert "12.9" in out  # first-order waste at Daly's interval, percent


def test_cli_rejects_non_positive_input(capsys):
    rc, out, err = run_cli(
        capsys, "plan-interval", "--mtbf-hours", "10000", "--gpus", "0", "--checkpoint-seconds", "300"
    )
    assert rc == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err


def test_the_planning_mtbf_is_configured_until_three_failures_then_observed():
    configured = planning_mtbf_s(10_000, 1000, [100.0, 200.0], run_start=0.0, now=3600.0)
    assert configured == (36_000.0, "configured")
    assert planning_mtbf_s(10_000, 1000, [100.0, 200.0, 300.0], run_start=0.0, now=3600.0) == (1200.0, "observed")


def test_the_auto_schedule_uses_daly_but_never_an_interval_shorter_than_one_save():
    fixed = CheckpointSchedule(5)
    assert [s for s in range(1, 21) if fixed.due(s)] == [5, 10, 15, 20]
    auto = CheckpointSchedule(5, mtbf_s=36_000.0, last_save_step=3)
    assert not auto.due(5) and auto.due(6)  # the first save comes early: its cost is measured
    planned = auto.update(cost_s=300.0, save_s=400.0, step_time_s=10.0)
    assert planned["checkpoint_interval_s"] == daly_interval_s(300.0, 36_000.0)
    assert auto.steps == round(daly_interval_s(300.0, 36_000.0) / 10.0)
    auto.update(cost_s=0.0, save_s=30.0, step_time_s=1.0)  # Daly at the 1 ms floor: ~8.5 s < one 30 s save
    assert auto.steps == 30
    auto.saved(100)
    assert not auto.due(129) and auto.due(130)
