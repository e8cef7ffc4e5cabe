"""No rank commits a checkpoint another rank failed to write (two real gloo ranks, real DCP files, no Ray)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO


def test_a_save_that_fails_on_one_rank_after_the_other_finished_commits_nowhere_and_both_resume_older(tmp_path):
    """Rank 1's write of step 10 fails (a real file-size limit cuts it short) a second after rank 0
    finished writing its own file. DCP gathers every rank's write result before the metadata is
    written, so both ranks' saves fail; `Checkpointer._complete` re-raises instead of completing, the
    uncommitted folder is deleted, and both ranks restore step 5 bitwise (tests/scenarios/commit_gating.py)."""
    script = os.path.join(REPO, "tests", "scenarios", "commit_gating.py")
    r = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    rank0, rank1 = json.loads((tmp_path / "result.json").read_text())
    assert rank0["first_error"] is None and rank1["first_error"] is None  # step 5 was a normal save
    assert rank0["own_file_written_s_before_failure"] > 0.5  # rank 0 had finished its part
    for rank in (rank0, rank1):
        # the save failed on every rank: DCP gathered rank 1's failed write (torch's writer saw the
        # short write the file-size limit caused, "unexpected pos") into its CheckpointException, and
        # every rank turned it into the one line a full disk gives (`Checkpointer._written`)
        assert rank["error"].startswith("StorageFullError: checkpoint step-10 does not fit on "), rank["error"]
        assert rank["committed"] == [5]
        assert rank["restored_step"] == 5
        assert len(rank["tensors_restored"]) == 3 and rank["tensors_equal_to_step_5"] == rank["tensors_restored"]
        assert rank["step_10_left"] is False
