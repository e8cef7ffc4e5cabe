"""Every wait is bounded: the bounds' conflicts (`raytrain-ft check`) and each bound firing, without Ray."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.train_state import KEY_MODEL, ModelState, TrainState
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.core.run_folder import read_commit_ack, write_commit_ack
from raytrain_ft.core.waits import WaitTimeoutError, bounded, conflicts, wait_for
from raytrain_ft.data.batches import Batches
from raytrain_ft.data.position import BatchPlan, DataPosition, Share
from raytrain_ft.resilience.storage_faults import SlowWriter


def test_bounds_that_cannot_work_together_are_each_one_line():
    cfg = load_config(
        None,
        [
            "failure.collective_timeout_s=60",
            "failure.hang_timeout_s=30",
            "waits.data_timeout_s=30",
            "waits.commit_timeout_s=0.5",
            "waits.quorum_timeout_s=10",
            "failure.recovery=replica",
        ],
    )
    assert conflicts(cfg, checkpoint_bytes=14_000_000_000) == [
        "failure.collective_timeout_s=60 is shorter than twice the slowest checkpoint stage of the plan (one rank "
        "writes 14.0 GB: about 70 s at 200 MB/s), which ranks wait out in the save's collectives; raise it to at "
        "least 140",
        "waits.commit_timeout_s=0.5 is not longer than two of Ray Train's report polls (0.5 s each): a commit is "
        "registered at a poll, so every wait would expire; raise it above 1",
        "waits.quorum_timeout_s=10 is not longer than the lighthouse's join window (10 s): the first quorum times "
        "out while replicas may still join; raise it above 10",
    ]


def test_the_default_bounds_work_together():
    assert conflicts(load_config(None, []), checkpoint_bytes=10_000_000_000) == []


def test_a_bound_of_zero_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^config key 'waits.commit_timeout_s' must be > 0 \(seconds\), got 0.0$"):
        load_config(None, ["waits.commit_timeout_s=0"])


def test_a_commit_that_is_never_acknowledged_fails_the_attempt_in_one_line(tmp_path):
    root = str(tmp_path)
    write_commit_ack(root, f"{root}/step-5")  # Ray registered step 5; step 10's registration never comes
    with pytest.raises(WaitTimeoutError) as e:
        wait_for(
            lambda: read_commit_ack(root) == f"{root}/step-10",
            0.3,
            f"rank 0: Ray Train's registration of {root}/step-10",
            "waits.commit_timeout_s",
        )
    assert str(e.value) == (
        f"rank 0: Ray Train's registration of {root}/step-10 did not happen within 0.3 s (waits.commit_timeout_s)"
    )


class StalledSession:
    """A data source whose second read never returns (a stuck Ray Data read task)."""

    rank = 1

    def micro_batches(self, epoch, start, stop, plan, rank):
        yield {"tokens": torch.zeros(2, 9, dtype=torch.int64), "sample_id": torch.arange(2)}
        time.sleep(3600)
        yield {}


def test_a_data_read_that_stalls_fails_the_attempt_naming_the_rank_and_the_position():
    plan = BatchPlan(global_batch_size=2, micro_batch_size=2, world_size=1)
    share, position = Share(plan, 0), DataPosition()
    batches = Batches(StalledSession(), 10, position, share, timeout_s=0.5)  # type: ignore[arg-type]
    assert len(batches.take(position, share)) == 1  # step 1's batch came
    position.advance(2, 10)
    with pytest.raises(WaitTimeoutError) as e:
        batches.take(position, share)
    assert str(e.value) == (
        "rank 1: the data pipeline (epoch 0, from sample 0) gave nothing for 0.5 s (waits.data_timeout_s); "
        "the read is stalled"
    )


def test_a_bounded_iterator_passes_items_and_errors_through():
    def items():
        yield 1
        raise ValueError("bad row group")

    it = bounded(items(), 5.0, "x")
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad row group"):
        next(it)


def test_the_checkpoint_groups_time_out_at_the_collective_timeout(tmp_path, process_group):
    ckpt = Checkpointer(str(tmp_path), timeout_s=7)
    for group in (ckpt.save_group, ckpt.control_group):  # torch's default for a new group: 30 minutes
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=7)


def test_a_checkpoint_write_that_stalls_fails_the_attempt_in_one_line(tmp_path, process_group):
    state = TrainState(0)
    state.add(KEY_MODEL, ModelState(torch.nn.Linear(8, 8)))
    ckpt = Checkpointer(str(tmp_path), timeout_s=1)
    ckpt.save(4, state, lambda path: SlowWriter(path, 5))  # the storage holds the write back 5 s
    with pytest.raises(WaitTimeoutError) as e:
        ckpt.wait()
    assert str(e.value) == (
        "rank 0: checkpoint step-4's write did not finish within 1 s (failure.collective_timeout_s); the storage "
        "is stalled or too slow for the bound"
    )
