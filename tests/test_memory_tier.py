"""The memory tier on a real local Ray instance (one node): a killed worker resumes from its node's memory."""

from __future__ import annotations

import pytest

from conftest import GUARDED, assert_resumed, assert_same_state, events, final_state, make_config, run_root
from raytrain_ft.data.audit import read_audit
from raytrain_ft.launch.driver import run

pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_killed_worker_resumes_from_its_nodes_memory_at_the_newest_memory_step(tmp_path, dataset, reference):
    """Durable checkpoints every 10 steps, memory ones every 3: rank 1 killed before step 17 (the
    injected fault settles both tiers first) resumes from the memory checkpoint of step 15, not the durable
    one of step 10, and ends bitwise equal to the uninterrupted run, every sample once."""
    cfg = make_config(
        tmp_path,
        dataset,
        "run.name=mem",
        "train.max_steps=30",
        "data.audit=true",
        *GUARDED,
        "checkpoint.interval_steps=10",
        "checkpoint.memory.interval_steps=3",
        f"checkpoint.memory.dir={tmp_path / 'shm'}",
        "faults=[{kind: kill, step: 17, rank: 1}]",
    )
    run_id = run(cfg)
    attempts = assert_resumed(cfg.tracking.uri, run_id, [0, 15])
    assert [a["restored_from"] for a in attempts] == ["", "memory"]
    ref_cfg, _, ref_state = reference
    assert_same_state(final_state(cfg, 30), ref_state)
    assert read_audit(run_root(cfg)).equals(read_audit(run_root(ref_cfg)))
    assert not events(cfg.tracking.uri, run_id, "memory_checkpoint_not_committed")
