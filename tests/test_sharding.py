"""Sharded data parallelism on real runs (2-4 gloo ranks, tiny preset, FSDP2 on CPU).

The runs are Ray-free (`local_run`: gloo ranks on a `LocalSession`, restarted from the last commit
after a failed attempt), except the DDP `reference` the cross-load test reads. One uninterrupted
FSDP run (`conftest.fsdp_ref`, with a NaN on rank 1 at step 8) is shared by the resume and guard
tests (resharding across world sizes: test_data_resume.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from mlflow.tracking import MlflowClient

from conftest import (
    FSDP,
    NAN_AT_8,
    REPO,
    assert_resumed,
    assert_same_state,
    events,
    final_state,
    make_config,
    metric_by_step,
    run_root,
)
from local_run import local_run


def test_fsdp_run_resumes_bitwise_after_a_kill_and_skips_a_one_rank_nan_everywhere(tmp_path, dataset, fsdp_ref):
    ref_cfg, ref_run, ref_state = fsdp_ref
    cfg = make_config(
        tmp_path, dataset, "run.name=fsdp", *FSDP, f"faults=[{NAN_AT_8}, {{kind: kill, step: 17, rank: 1}}]"
    )
    run_id = local_run(cfg)
    assert_resumed(cfg.tracking.uri, run_id, [0, 15])
    assert_same_state(final_state(cfg, 30), ref_state)
    loss, ref_loss = metric_by_step(cfg, run_id, "train/loss"), metric_by_step(ref_cfg, ref_run, "train/loss")
    assert sorted(loss) == sorted(ref_loss) == list(range(1, 31))
    np.testing.assert_array_equal([loss[s] for s in loss], [ref_loss[s] for s in loss])  # NaN at 8 in both
    # the NaN on rank 1 made the global grad norm NaN on both ranks: both skipped step 8 (else the
    # skip all-reduce raises SkipDisagreementError), in both runs
    for c, r in ((cfg, run_id), (ref_cfg, ref_run)):
        assert [e["step"] for e in events(c.tracking.uri, r, "skipped_step")] == [8]
    tags = MlflowClient(ref_cfg.tracking.uri).get_run(ref_run).data.tags
    assert tags["parallel.strategy"] == "fsdp" and tags["replica_fingerprint"].startswith("not applicable")


def test_checkpoints_load_across_ddp_and_fsdp_and_reshard_to_another_world_size_with_every_tensor_equal(
    tmp_path, reference, fsdp_ref
):
    """Step-30 of the 2-rank runs loaded at 3 ranks, as a resume at another world size loads it (torch
    only): DDP's under FSDP, FSDP's under DDP, and FSDP's 2 shards resharded into FSDP's 3 (dim 0 of
    every weight and AdamW moment, split unevenly: the tiny model's dims are not multiples of 3).
    The full weights and optimizer state gathered after the load equal the saved ones, tensor for
    tensor (`torch.equal`)."""
    cases = {
        "ddp_to_fsdp": (reference[0], "fsdp"),
        "fsdp_to_ddp": (fsdp_ref[0], "ddp"),
        "fsdp_resharded": (fsdp_ref[0], "fsdp"),
    }
    args = [f"{name}={run_root(cfg)}/step-30={strategy}" for name, (cfg, strategy) in cases.items()]
    out = tmp_path / "loaded"
    script = os.path.join(REPO, "tests", "scenarios", "sharded_state.py")
    r = subprocess.run(
        [sys.executable, script, str(out), "--world-size", "3", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    import torch

    for name, (cfg, _) in cases.items():
        loaded = torch.load(out / f"{name}.pt")
        assert_same_state(loaded, final_state(cfg, 30))
    assert json.loads((out / "result.json").read_text())["world_size"] == 3


# HSDP on 4 workers: 2 replicas x 2 shards; every guard at a short interval, `on_alert: restart`
HSDP_20 = [
    "run.name=h",
    "parallel.strategy=hsdp",
    "parallel.shard_size=2",
    "scaling.num_workers=4",
    "train.max_steps=20",
    "guards.fingerprint.interval_steps=5",
    "guards.on_alert=restart",
]


def test_hsdp_bitflip_in_one_shard_is_caught_across_replicas_and_the_restart_ends_clean(tmp_path, dataset):
    clean = make_config(tmp_path / "clean", dataset, *HSDP_20)
    clean_run = local_run(clean)
    cfg = make_config(tmp_path / "flip", dataset, *HSDP_20, "faults=[{kind: bitflip, step: 12, rank: 3}]")
    run_id = local_run(cfg)
    [alert] = events(cfg.tracking.uri, run_id, "replica_mismatch")
    assert alert["step"] == 15
    (s0, c0), (s1, c1), (s2, c2), (s3, c3) = alert["shard_checksum_by_rank"]
    assert (s0, s1, s2, s3) == (0, 1, 0, 1)  # rank r holds shard r % 2
    assert c0 == c2 and c1 != c3  # shard 1 differs between replica 0 (rank 1) and replica 1 (rank 3)
    assert_resumed(cfg.tracking.uri, run_id, [0, 10])
    assert_same_state(final_state(cfg, 20), final_state(clean, 20))
    assert events(clean.tracking.uri, clean_run, "replica_mismatch") == []
    assert MlflowClient(clean.tracking.uri).get_run(clean_run).data.tags["replica_fingerprint"] == "on"
