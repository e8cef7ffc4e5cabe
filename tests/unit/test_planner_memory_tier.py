"""The goodput planner's memory tier (`raytrain_ft.resilience.planner`, `raytrain-ft plan-goodput
--memory-checkpoint-seconds`): off, every result as before; on, the schedule of both tiers against an
event walk, the loss per failure bounded by the memory interval, and the command. No Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import sqlite_store
from raytrain_ft.cli import main
from raytrain_ft.resilience import planner
from raytrain_ft.resilience.planner import Cluster, Costs, Month, Schedule
from raytrain_ft.telemetry.tracking import MlflowRecorder, start_or_resume_run

DESIGN = Cluster(gpus=1_000, mtbf_hours=10_000.0)  # cluster MTBF 36,000 s
DURABLE = planner.DEFAULT_COSTS  # a 300 s durable checkpoint, a 600 s restart, 10 s steps
CHEAP = Costs(300.0, 300.0, 600.0, 300.0, 10.0, memory_checkpoint_s=5.0, memory_save_s=10.0)

# computed before the memory tier existed: `planner.plan(cluster, costs, repetitions=60, seed=1)`,
# {mode: (interval_s, goodput, lost_work, checkpoint_stalls)}
BEFORE = [
    (
        Cluster(1_000, 10_000.0),
        DURABLE,
        {
            "restart": (4190.0, 0.8640980984595974, 0.05806730883184882, 0.0618083581406526),
            "replica": (4450.0, 0.9366829101309228, 0.00013416628243187228, 0.0631477089261518),
        },
    ),
    (
        Cluster(1_000, 10_000.0, clustered=0.3, gpus_per_replica=4),
        Costs(1.0, 60.0, 600.0, 300.0, 0.68),
        {
            "restart": (272.0, 0.9704114504308389, 0.005130849812668135, 0.0035674939459163306),
            "replica": (267.92, 0.9961944355661198, 9.123307205367316e-06, 0.0037184119600081325),
        },
    ),
]


@pytest.mark.parametrize("case", range(len(BEFORE)))
def test_with_the_memory_tier_off_every_result_is_what_it_was(case):
    cluster, costs, before = BEFORE[case]
    out = planner.plan(cluster, costs, repetitions=60, seed=1)
    assert set(out) == {"young_s", "daly_s", "modes"}
    for mode, (interval, goodput, lost_work, stalls) in before.items():
        p = out["modes"][mode]
        assert "memory_interval_s" not in p
        assert p["interval_s"] == interval
        assert (p["goodput"], p["lost"]["lost_work"], p["lost"]["checkpoint_stalls"]) == pytest.approx(
            (goodput, lost_work, stalls), rel=1e-12
        )


def _saves(s: Schedule, horizon: float) -> list[tuple[float, float, float, float, float]]:
    """(snapshot, commit, end of stall, compute, stalls so far) of every save of a stretch, in
    order, walked one save at a time: the schedule `Schedule` computes in closed form."""
    out, wall, compute, stalls = [], 0.0, 0.0, 0.0
    while wall < horizon:
        steps = [(s.memory_tau, s.memory_stall, s.memory_save)] * s.memories
        for tau, stall, save in [*steps, (s.tau - s.memories * s.memory_tau, s.stall, s.save)]:
            wall, compute = wall + tau, compute + tau
            out.append((wall, wall + save, wall + stall, compute, stalls + stall))
            wall, stalls = wall + stall, stalls + stall
    return out


def _walked(s: Schedule, running: float) -> tuple[tuple[float, float, float], float]:
    """(`Schedule.kept`, `Schedule.compute`) of one stretch by walking its saves."""
    saves = _saves(s, running + 1)
    committed = [x for x in saves if x[1] <= running]
    newest = max(committed, key=lambda x: x[0]) if committed else (0.0, 0.0, 0.0, 0.0, 0.0)
    end, done = 0.0, 0.0
    for snapshot, _, stall_end, compute, _ in saves:
        if running <= snapshot:
            return (newest[3], newest[4], newest[2]), done + running - end
        if running <= stall_end:
            return (newest[3], newest[4], newest[2]), compute
        end, done = stall_end, compute
    raise AssertionError("the walk ends after the stretch")


def test_the_schedule_of_both_tiers_is_the_walk_of_its_saves():
    """Random costs and intervals (memory interval shorter or longer than the durable one, commit
    lags longer than an interval), 40 stretch lengths each: the vectorised newest committed
    checkpoint and compute equal a save-by-save walk."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        stall, memory_stall = rng.uniform(1, 300), rng.uniform(0.5, 10)
        costs = Costs(
            stall, stall + rng.uniform(0, 500), 0.0, 0.0, 1.0, 0.0, memory_stall, memory_stall + rng.uniform(0, 300)
        )
        s = Schedule.of(costs, rng.uniform(10, 2_000), rng.uniform(20, 200))
        running = rng.uniform(0, 20_000, 40)
        kept, compute = np.stack(s.kept(running), axis=1), s.compute(running)
        for j, r in enumerate(running):
            walked_kept, walked_compute = _walked(s, r)
            assert kept[j] == pytest.approx(walked_kept, abs=1e-6), (s, r)
            assert compute[j] == pytest.approx(walked_compute, abs=1e-6), (s, r)


def test_a_memory_save_that_falls_on_a_durable_save_is_skipped():
    assert Schedule.of(CHEAP, 4_450.0, 600.0).memories == 7  # 600 ... 4,200 s, then the durable save
    assert Schedule.of(CHEAP, 4_200.0, 600.0).memories == 6  # the one at 4,200 s is the durable save
    assert Schedule.of(CHEAP, 600.0, 4_450.0).memories == 0  # no memory save between durable ones
    assert Schedule.of(CHEAP, 4_200.0, 600.0).period == 4_200.0 + 6 * 5.0 + 300.0


def test_the_memory_interval_is_dalys_in_whole_steps_and_never_shorter_than_its_save():
    assert planner.memory_steps_s(DURABLE, DESIGN.mtbf_s) is None
    assert planner.memory_steps_s(CHEAP, DESIGN.mtbf_s) == 600.0  # Daly's 596.7 s in 10 s steps
    slow = Costs(300.0, 300.0, 600.0, 300.0, 10.0, memory_checkpoint_s=5.0, memory_save_s=1_234.0)
    assert planner.memory_steps_s(slow, DESIGN.mtbf_s) == 1_230.0


def test_a_cheap_memory_tier_raises_restart_goodput_and_bounds_the_loss_per_failure():
    """The design point (1,000 GPUs at 10,000 h, a 300 s durable checkpoint, a 600 s restart) with
    a 5 s memory stall committed 10 s after its start: a memory checkpoint every 10 min. A failure
    then loses about half a memory interval (and its commit lag), not half of the 74-minute
    durable interval; every failure loses less than a memory interval plus the longer commit lag.
    Red when the lost work ignores the memory tier (about 2,200 s per failure)."""
    off = planner.plan(DESIGN, DURABLE, ("restart",), repetitions=100)["modes"]["restart"]
    on = planner.plan(DESIGN, CHEAP, ("restart",), repetitions=100)["modes"]["restart"]
    memory = on["memory_interval_s"]
    assert memory == 600.0 and on["interval_s"] == planner.daly_steps_s(CHEAP, DESIGN.mtbf_s)
    assert on["goodput"] > off["goodput"] + 0.03
    per_failure = {  # lost seconds per failure: failures strike the running time at 1 / MTBF
        name: p["lost"]["lost_work"] * DESIGN.mtbf_s / (1 - p["lost"]["restarts"])
        for name, p in (("off", off), ("on", on))
    }
    assert per_failure["off"] > 1_500.0
    assert memory / 2 <= per_failure["on"] <= memory
    month = Month(DESIGN, repetitions=100)
    s = Schedule.of(CHEAP, on["interval_s"], memory)
    lost = month.gaps - s.kept(month.gaps)[2]
    assert lost.min() >= 0.0 and lost.max() < memory + max(CHEAP.memory_save_s, CHEAP.save_s)


def test_both_tiers_stalls_count_in_restart_mode_and_replica_mode_ignores_the_tier():
    """`restart` at 4,450 s of compute per durable period: the stalls' share of the kept time is the
    durable one, 300 s per 4,750 s, with the tier off; with it on it rises, up to a whole period's
    300 s + 7 x 5 s per 4,785 s (a stretch kept up to a memory save has not paid its period's
    durable stall). `replica` is the month without the tier, as the config refuses the tier there."""
    month, interval = Month(DESIGN, repetitions=100), 4_450.0
    off, on = (month.simulate("restart", c, interval) for c in (DURABLE, CHEAP))
    share = {
        name: p.lost["checkpoint_stalls"] / (p.goodput + p.lost["checkpoint_stalls"])
        for name, p in (("off", off), ("on", on))
    }
    assert share["off"] == pytest.approx(300.0 / 4_750.0, rel=0.01)
    assert share["off"] * 1.03 < share["on"] < 335.0 / 4_785.0
    assert on.goodput + sum(on.lost.values()) == pytest.approx(1.0, abs=1e-9)
    assert month.simulate("replica", CHEAP, interval) == month.simulate("replica", DURABLE, interval)


def test_the_memory_tier_alone_is_the_one_tier_model_at_its_interval():
    """No durable save within the month (its interval longer than the month): the two-tier
    schedule is the one-tier model with the memory tier's costs at the memory interval."""
    month, memory = Month(DESIGN, repetitions=50), planner.memory_steps_s(CHEAP, DESIGN.mtbf_s)
    two = month.simulate("restart", CHEAP, 2 * DESIGN.wall_s)
    one = month.simulate("restart", Costs(5.0, 10.0, 600.0, 300.0, 10.0), memory)
    assert two.goodput == pytest.approx(one.goodput, rel=1e-9)
    assert two.lost == pytest.approx(one.lost, rel=1e-9, abs=1e-12)


def test_measured_costs_take_the_memory_tiers_means():
    metrics = {"memory_checkpoint_cost_s": [4.0, 6.0], "memory_checkpoint_save_s": [10.0, 20.0]}
    assert planner.measured_costs([], metrics, []) == {"memory_checkpoint_s": 5.0, "memory_save_s": 15.0}


def test_plan_goodput_memory_flags_json_table_and_refusals(capsys):
    argv = ["plan-goodput", "--memory-checkpoint-seconds", "5", "--repetitions", "5"]
    assert main([*argv, "--memory-save-seconds", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_daly_s"] == pytest.approx(596.7, abs=0.1)
    assert out["modes"]["restart"]["memory_interval_s"] == 600.0
    assert "memory_interval_s" not in out["modes"]["replica"]  # the model draws single replica failures: no tier
    assert main([*argv, "--mode", "restart"]) == 0  # the save defaults to the stall
    text = capsys.readouterr().out
    assert "memory_checkpoint_s 5 (flag), memory_save_s 5 (default)" in text
    assert "memory interval (min)" in text and "memory tier: Daly interval 9.9 min" in text
    assert main(["plan-goodput", "--memory-checkpoint-seconds", "5", "--memory-save-seconds", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: memory_save_s (1.0 s) is shorter than the stall memory_checkpoint_s (5.0 s)"
    ]
    assert main(["plan-goodput", "--memory-save-seconds", "10"]) == 2
    assert "without a memory stall" in capsys.readouterr().err
    assert main(["plan-goodput", "--repetitions", "5"]) == 0
    assert "memory" not in capsys.readouterr().out  # off: today's output


def test_plan_goodput_from_run_takes_the_memory_tiers_measured_costs(tmp_path, capsys):
    uri = sqlite_store(tmp_path)
    run_id = start_or_resume_run(uri, "raytrain-ft", str(tmp_path / "runs" / "tiers"), "tiers", {})
    rec = MlflowRecorder(uri, run_id)
    rec.metrics(1, {"train/step_time_s": 10.0, "checkpoint_cost_s": 2.0, "memory_checkpoint_cost_s": 4.0})
    rec.metrics(2, {"memory_checkpoint_cost_s": 6.0, "memory_checkpoint_save_s": 15.0})
    assert rec.drain(30.0)
    argv = ["plan-goodput", "--from-run", "tiers", "--tracking-uri", uri, "--repetitions", "5", "--mode", "restart"]
    assert main(argv) == 0
    assert "memory_checkpoint_s 5 (run), memory_save_s 15 (run)" in capsys.readouterr().out
    assert main([*argv, "--memory-checkpoint-seconds", "0"]) == 0  # a flag turns the tier off
    assert "memory" not in capsys.readouterr().out
