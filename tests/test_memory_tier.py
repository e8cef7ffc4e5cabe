"""The memory tier on a real multi-node Ray cluster: a killed worker resumes from its node's memory, a lost
node's ranks from their peer copies, and damaged copies fall back to durable storage."""

from __future__ import annotations

import pytest
from scenarios.memory_tier import memory_config

from conftest import (
    assert_resumed,
    assert_same_state,
    events,
    final_state,
    run_root,
    run_scenario,
)
from raytrain_ft.data.audit import read_audit

pytestmark = pytest.mark.exclusive


def test_a_lost_node_restores_from_peer_copies_and_damaged_copies_fall_back_to_storage(tmp_path, dataset, reference):
    """tests/scenarios/memory_tier.py, on a 3-node `Cluster`: rank 1's node removed at step 14 -> memory step
    12, rank 1 from its peer copy; rank 0 killed before step 20 -> memory step 18 from the nodes' own copies;
    both copies of rank 0's step 24 damaged, then a kill -> the durable step 20, each damaged copy recorded.
    Every attempt's step and tier, the weights bitwise equal to the uninterrupted run, every sample once."""
    out = run_scenario("memory_tier.py", dataset, str(tmp_path))
    cfg = memory_config(dataset, str(tmp_path))
    attempts = assert_resumed(cfg.tracking.uri, out["run_id"], [0, 12, 18, 20])
    assert [a["restored_from"] for a in attempts] == ["", "peer", "memory", "storage"]
    ref_cfg, _, ref_state = reference
    assert_same_state(final_state(cfg, 30), ref_state)
    assert read_audit(run_root(cfg)).equals(read_audit(run_root(ref_cfg)))
    corrupt = [e for e in events(cfg.tracking.uri, out["run_id"], "corrupt_checkpoint") if e["time"] > out["paused"]]
    assert len(corrupt) == 2 and all("rank-0/step-24" in e["path"] or "rank 0" in e["path"] for e in corrupt)
    # the removed node's copies were never read: no attempt after its loss names it
    assert all(out["removed_node"] not in e["path"] for e in corrupt)
