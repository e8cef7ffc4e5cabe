"""Unit level: every non-tensor component round-trips exactly; an async snapshot is never torn."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import assert_tensors_equal
from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.integrity import ChecksummedWriter
from raytrain_ft.checkpoint.reader import load_model_state_dict
from raytrain_ft.checkpoint.train_state import (
    KEY_META,
    KEY_MODEL,
    KEY_OPTIM,
    ModelState,
    OptimizerState,
    Pickled,
    Progress,
    RNGState,
    RunMeta,
    TrainState,
)
from raytrain_ft.core.config import TrainSection
from raytrain_ft.core.errors import CheckpointError
from raytrain_ft.core.run_folder import step_path
from raytrain_ft.core.schedule import lr_schedule
from raytrain_ft.resilience.storage_faults import SlowWriter


def test_rng_states_round_trip_exactly(tmp_path):
    rng = RNGState()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    dcp.save({"rng": Pickled(rng)}, checkpoint_id=str(tmp_path), no_dist=True)
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    dcp.load({"rng": Pickled(rng)}, checkpoint_id=str(tmp_path), no_dist=True)
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


def test_scheduler_state_round_trips_exactly(tmp_path):
    t = TrainSection(max_steps=50, warmup_steps=5)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=t.lr)
    sched = lr_schedule(opt, t)
    for _ in range(12):
        opt.step(), sched.step()
    dcp.save({"scheduler": Pickled(sched)}, checkpoint_id=str(tmp_path), no_dist=True)
    lrs = []
    for _ in range(10):
        opt.step(), sched.step()
        lrs.append(sched.get_last_lr()[0])
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=t.lr)
    sched2 = lr_schedule(opt2, t)
    dcp.load({"scheduler": Pickled(sched2)}, checkpoint_id=str(tmp_path), no_dist=True)
    opt2.param_groups[0]["lr"] = sched2.get_last_lr()[0]
    resumed = []
    for _ in range(10):
        opt2.step(), sched2.step()
        resumed.append(sched2.get_last_lr()[0])
    assert resumed == lrs and lrs[0] != lrs[-1]


def test_a_save_while_one_is_in_flight_is_refused_and_each_completed_step_is_returned(tmp_path, process_group):
    # at most one save in flight: the caller completes (and commits) the previous one first, so no
    # completed step is lost inside `save` (`raytrain_ft.training.commits.Commits.save`: `after_commit(wait())`)
    state = TrainState(rank=0)
    state.add("model", ModelState(torch.nn.Linear(8, 8)))
    ckpt = Checkpointer(str(tmp_path))
    assert ckpt.poll() is None and ckpt.wait() is None  # nothing in flight: nothing completes
    ckpt.save(1, state, lambda path: SlowWriter(path, 0.5))
    with pytest.raises(RuntimeError, match=r"^step-1 is still in flight: wait\(\) for it before saving step-2$"):
        ckpt.save(2, state)
    assert ckpt.wait() == 1 and ckpt.pending is None
    ckpt.save(2, state)
    while (complete := ckpt.poll()) is None:
        pass
    assert complete == 2 and ckpt.wait() is None


def test_async_snapshot_is_not_torn_by_later_updates(tmp_path, process_group, monkeypatch):
    # the writer blocks until the test releases it: the update below lands while the write is in
    # flight by construction (an event, not a sleep that a loaded machine can outrun)
    release = threading.Event()

    def gated_write(self, plan, planner):
        release.wait(timeout=120)
        return ChecksummedWriter.write_data(self, plan, planner)

    monkeypatch.setattr(SlowWriter, "write_data", gated_write)
    model = torch.nn.Linear(64, 64)
    state = TrainState(rank=0)
    state.add("model", ModelState(model))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(7, state, lambda path: SlowWriter(path, 1.0))
    ckpt.wait_staged()
    with torch.no_grad():  # an optimizer step right after the snapshot, while the write is held
        for p in model.parameters():
            p.add_(1.0)
    assert not ckpt.pending[2].done()
    release.set()
    assert ckpt.wait() == 7
    assert_tensors_equal(load_model_state_dict(step_path(str(tmp_path), 7)), expected)
    assert not torch.equal(model.weight, expected["weight"])


def test_a_checkpoint_without_model_weights_is_refused(tmp_path, process_group):
    # a resuming rank leaves its weights uninitialised (parallel.build(resuming=True)): a checkpoint
    # that holds none is unusable (recorded), never "loaded" around the model
    path = str(tmp_path / "step-3")
    dcp.save({KEY_META: RunMeta({}), "progress": Pickled(Progress(step=3))}, storage_writer=ChecksummedWriter(path))
    state = TrainState(rank=0)
    state.add(KEY_META, RunMeta({}))
    state.add(KEY_MODEL, ModelState(torch.nn.Linear(4, 4)))
    state.add("progress", Pickled(Progress()))
    corrupt = []
    with pytest.raises(CheckpointError, match="none of the committed checkpoints .* incomplete: no 'model' entries"):
        Checkpointer(str(tmp_path)).restore(state, [path], lambda *a: corrupt.append(a))
    assert corrupt == [(path, f"{path}: incomplete: no 'model' entries")]


def test_restore_creates_adamw_state_from_the_checkpoint_without_an_optimizer_step(
    tmp_path, process_group, monkeypatch
):
    # DCP would create AdamW's state for the load by a zero-gradient step (1 s of a restart on the
    # demo config); the restore allocates it from the checkpoint's metadata instead, and the loaded
    # state is every tensor of the saved one, dtype, shape and value
    def trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for _ in range(steps):
            model(torch.randn(4, 8)).square().sum().backward()
            opt.step(), opt.zero_grad()
        return model, opt

    def state_of(model, opt) -> TrainState:
        state = TrainState(rank=0)
        state.add(KEY_META, RunMeta({}))
        state.add(KEY_MODEL, ModelState(model))
        state.add(KEY_OPTIM, OptimizerState(model, opt))
        return state

    saved_model, saved_opt = trained(3)
    path = step_path(str(tmp_path), 3)
    dcp.save(state_of(saved_model, saved_opt).components, storage_writer=ChecksummedWriter(path))
    model, opt = trained(0)

    def no_step(*args, **kwargs):
        raise AssertionError("the restore ran an optimizer step")

    monkeypatch.setattr(opt, "step", no_step)
    loaded, _ = Checkpointer(str(tmp_path)).restore(state_of(model, opt), [path], print)
    assert loaded == path
    expected, got = saved_opt.state_dict(), opt.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    assert sorted(got["state"]) == sorted(expected["state"]) == [0, 1, 2, 3]
    for i, entries in expected["state"].items():
        assert sorted(got["state"][i]) == ["exp_avg", "exp_avg_sq", "step"]
        for name, t in entries.items():
            assert got["state"][i][name].dtype == t.dtype and torch.equal(got["state"][i][name], t), (i, name)
