"""A checkpoint write that fails inside DCP: out of space becomes the one line of the pre-save check.

A real `dcp.async_save` through `Checkpointer` on a one-rank gloo group; only the storage writer's
`write_data` raises, as a disk that fills up between the pre-save check and the write does (DCP
gathers the rank's error into its `CheckpointException`, a `BaseException` in torch 2.13).
"""

from __future__ import annotations

import errno

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.integrity import ChecksummedWriter
from raytrain_ft.checkpoint.train_state import KEY_MODEL, ModelState, TrainState
from raytrain_ft.core.errors import StorageFullError


def failing_writer(error: BaseException) -> type[ChecksummedWriter]:
    class Failing(ChecksummedWriter):
        def write_data(self, plan, planner):
            raise error

    return Failing


@pytest.fixture
def saved_once(tmp_path, process_group):
    """A `Checkpointer` whose run folder holds one complete save (step 2) of a small model."""
    state = TrainState(0)
    state.add(KEY_MODEL, ModelState(torch.nn.Linear(64, 64)))
    ckpt = Checkpointer(str(tmp_path / "run"))
    ckpt.save(2, state)
    assert ckpt.wait() == 2
    return ckpt, state


def commit(ckpt: Checkpointer, finish: str) -> int | None:
    """Finish the pending save the way the loop does: `wait()` (final save, settle), or `poll()` every step."""
    if finish == "wait":
        return ckpt.wait()
    while (step := ckpt.poll()) is None:
        pass
    return step


@pytest.mark.parametrize("finish", ["wait", "poll"])
def test_a_write_that_runs_out_of_space_is_one_line(saved_once, tmp_path, finish):
    ckpt, state = saved_once
    # the kernel's errno with a text that does not say "No space left": found through DCP's per-rank failures
    ckpt.save(4, state, failing_writer(OSError(errno.ENOSPC, "quota exhausted")))
    with pytest.raises(StorageFullError) as e:
        commit(ckpt, finish)
    message = str(e.value)
    assert "\n" not in message and e.value.__cause__ is None and e.value.__suppress_context__
    assert message.startswith(f"checkpoint step-4 does not fit on {tmp_path / 'run'}: about ")
    needed = int(message.split(": about ")[1].split()[0])
    assert needed > 64 * 64 * 4  # the size of the complete step-2 checkpoint: the estimate of this one
    assert message.endswith("free space there, lower checkpoint.num_to_keep, or move run.storage_path")


def test_any_other_failed_write_is_raised_as_dcp_raised_it(saved_once):
    ckpt, state = saved_once
    ckpt.save(4, state, failing_writer(OSError(errno.EIO, "I/O error")))
    with pytest.raises(CheckpointException) as e:  # not taken for a full disk
        ckpt.wait()
    [(error, _)] = e.value.failures.values()
    assert isinstance(error, OSError) and error.errno == errno.EIO
