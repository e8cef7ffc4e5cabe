"""Where a `kill` fault in a save lands (`storage_faults.CutWriter`): a real DCP save by a 1-rank gloo
group in a child process that the writer SIGKILLs; what the step folder holds at that moment is
recorded by the writer's `before_kill` and compared with a complete save of the same state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    from raytrain_ft.checkpoint.checkpointer import Checkpointer
    from raytrain_ft.checkpoint.integrity import ChecksummedWriter
    from raytrain_ft.checkpoint.train_state import ModelState, TrainState
    from raytrain_ft.resilience.storage_faults import CutWriter

    root, at = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    torch.manual_seed(0)
    state = TrainState(rank=0)
    state.add("model", ModelState(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])))
    ckpt = Checkpointer(root)

    def seen():
        folder = os.path.join(root, "step-1")
        files = {n: os.path.getsize(os.path.join(folder, n)) for n in sorted(os.listdir(folder))}
        with open(os.path.join(root, "seen.json"), "w") as f:
            json.dump(files, f)

    ckpt.save(1, state, (lambda path: CutWriter(path, at, seen)) if at else ChecksummedWriter)
    ckpt.wait()
    seen()
    """
)


def save(tmp_path, at: str) -> tuple[int, dict[str, int]]:
    """(the child's return code, {file: bytes} in its step folder when the writer cut it or the save ended)."""
    root = tmp_path / (at or "whole")
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", CHILD, str(root), at], env=env, timeout=120, capture_output=True)
    with open(root / "seen.json") as f:
        return done.returncode, json.load(f)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[int, dict[str, int]]:
    return save(tmp_path_factory.mktemp("cut"), "")


@pytest.mark.parametrize("at", ["write", "metadata"])
def test_a_kill_in_a_save_cuts_the_shard_or_the_metadata_as_its_moment_says(tmp_path, at, whole):
    whole_rc, whole = whole
    [shard] = [n for n in whole if n.endswith(".distcp")]
    assert whole_rc == 0 and ".metadata" in whole and whole[shard] > 4 * 64 * 64 * 4  # four 64x64 fp32 weights
    rc, cut = save(tmp_path, at)
    assert rc == -signal.SIGKILL
    assert ".metadata" not in cut and ".checksums" not in cut
    if at == "write":  # the first item of the rank's file on storage, the rest not
        assert 0 < cut[shard] < whole[shard] / 4
    else:  # every shard complete, nothing after
        assert cut[shard] == whole[shard]
