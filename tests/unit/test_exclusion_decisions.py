"""`straggler.action: exclude` as pure decisions (no Ray cluster, no process group): when a flagged rank
leaves, which worker group the driver starts without its node, and the run folder's record of it."""

from __future__ import annotations

import pytest

from conftest import REPO
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.core.run_folder import read_exclusions, record_exclusion
from raytrain_ft.launch.driver import without_nodes
from raytrain_ft.resilience.straggler import Exclusion, Straggler, StragglerDetector, exclusion

HEALTHY, RANK2_SLOW = [1.0, 1.0, 1.0], [1.0, 1.0, 3.0]


def judge_run(exclude: Exclusion, figures: list[list[float]]) -> dict[int, list[int]]:
    """{step: excluded ranks} over steps 1.. with these figures (detector: k = 2 of n = 3)."""
    detector, out = StragglerDetector(threshold=1.5, window=3, min_slow_steps=2), {}
    for step, f in enumerate(figures, 1):
        flagged, recovered = detector.observe(step, f)
        due = exclude.judge(step, len(f), flagged, recovered)
        if due:
            out[step] = [s.rank for s in due]
    return out


def test_a_rank_still_flagged_after_exclude_after_steps_is_excluded_at_that_step():
    # flagged at step 2 (slow at 1 and 2), still flagged 3 steps later: excluded after step 5, and at
    # every later step until the members change (the loop acts on the first)
    assert judge_run(Exclusion(after_steps=3, min_members=2), [RANK2_SLOW] * 6) == {5: [2], 6: [2]}
    # at its flag with after_steps 0
    assert judge_run(Exclusion(after_steps=0, min_members=2), [RANK2_SLOW] * 2) == {2: [2]}


def test_a_rank_that_recovers_before_the_bound_is_not_excluded():
    # flagged at 2, fast at 3 and 4 (2 of the last 3): recovered at 4, before its bound 2 + 3
    figures = [RANK2_SLOW, RANK2_SLOW, HEALTHY, HEALTHY, HEALTHY, HEALTHY]
    assert judge_run(Exclusion(after_steps=3, min_members=2), figures) == {}


def test_exclusion_keeps_the_minimum_of_members_and_restarts_on_a_new_member_count():
    both_slow = [1.0, 3.0, 3.0, 1.0]  # ranks 1 and 2 slow against the median of the others
    assert judge_run(Exclusion(after_steps=1, min_members=3), [both_slow] * 3) == {3: [1]}  # 4 - 3: one leaves
    assert judge_run(Exclusion(after_steps=1, min_members=4), [both_slow] * 3) == {}  # at the minimum: none
    exclude = Exclusion(after_steps=1, min_members=1)
    assert exclude.judge(5, 3, [Straggler(2, 3.0, 4)], []) == []
    assert exclude.judge(6, 2, [], []) == []  # the members changed: rank 2's flag is gone
    with pytest.raises(ValueError):
        Exclusion(after_steps=-1, min_members=1)


def test_the_config_builds_the_exclusion_of_its_recovery_mode(tmp_path):
    tiny = f"{REPO}/configs/tiny.yaml"
    assert exclusion(load_config(tiny, ["straggler.action=warn"])) is None
    restart = exclusion(load_config(tiny, ["straggler.action=exclude", "scaling.num_workers=[2,3]"]))
    assert restart is not None and (restart.after_steps, restart.min_members) == (30, 2)
    replica = exclusion(load_config(tiny, ["straggler.action=exclude", "failure.recovery=replica"]))
    assert replica is not None and replica.min_members == 1
    with pytest.raises(ConfigError, match="straggler.exclude_after_steps"):
        load_config(tiny, ["straggler.action=exclude", "straggler.exclude_after_steps=-1"])


def node(node_id: str, cpus: float, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus, "memory": 1e9}}


def test_the_next_group_is_kept_off_the_excluded_nodes_and_its_range_loses_their_workers():
    nodes = [node("aa", 1.0), node("bb", 1.0), node("cc", 2.0), node("dd", 1.0, alive=False)]
    assert without_nodes(2, 3, {"CPU": 0.8}, [], nodes) == ((2, 3), None)
    assert without_nodes(2, 3, {"CPU": 0.8}, ["bb"], nodes) == (2, {"ray.io/node-id": "!in(bb)"})
    # a node that holds two workers takes two off; never below the minimum; a dead node holds none
    assert without_nodes(1, 4, {"CPU": 1.0}, ["cc", "dd"], nodes) == ((1, 2), {"ray.io/node-id": "!in(cc,dd)"})
    assert without_nodes(2, 2, {"CPU": 1.0}, ["cc"], nodes) == (2, {"ray.io/node-id": "!in(cc)"})


def test_exclusions_are_read_back_after_a_time_oldest_first(tmp_path):
    root = str(tmp_path / "run")
    assert read_exclusions(root, since=0.0) == []
    old, new = (
        {"time": 100.0, "node": "aa", "rank": 1, "step": 10},
        {"time": 200.0, "node": "bb", "rank": 0, "step": 30},
    )
    record_exclusion(root, new)
    record_exclusion(root, old)
    assert read_exclusions(root, since=0.0) == [old, new]
    assert read_exclusions(root, since=150.0) == [new]
