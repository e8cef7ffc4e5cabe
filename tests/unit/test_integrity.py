"""Checkpoint integrity without Ray: one gloo rank, `Checkpointer`'s own async saves, real DCP files.

Bit flips are placed through the checkpoint's own DCP metadata (`storage_data`: file, offset, length
of each item), as a disk or an object store would damage them.
"""

from __future__ import annotations

import json
import os
import pickle
import threading

import pytest
import torch
import xxhash

from conftest import flip_bit, stored_item
from raytrain_ft import cli
from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.integrity import verify_checkpoint
from raytrain_ft.checkpoint.train_state import (
    COMPONENT_KEYS,
    KEY_DATA,
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
    missing_components,
    rng_key,
)
from raytrain_ft.core.errors import CheckpointError
from raytrain_ft.core.run_folder import CHECKSUM_FILE, step_path
from raytrain_ft.data.position import DataPosition


class Run:
    """Every component a run's checkpoint holds (`COMPONENT_KEYS` and this rank's RNG), around a small model."""

    def __init__(self, seed: int, rank: int = 0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.progress, self.position = Progress(), DataPosition()
        self.state = TrainState(rank)
        self.state.add(KEY_MODEL, ModelState(self.model))
        self.state.add(KEY_OPTIM, OptimizerState(self.model, self.opt))
        self.state.add(KEY_DATA, Pickled(self.position))
        self.state.add(KEY_META, RunMeta({"model.preset": "test"}))
        self.state.add(rng_key(rank), Pickled(RNGState()))
        for key in set(COMPONENT_KEYS) - set(self.state.components):  # scheduler, guards, ...: a step counter each
            self.state.add(key, Pickled(Progress()))

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.model(torch.randn(4, 16)).square().mean().backward()
            self.opt.step(), self.opt.zero_grad()
            self.progress.step += 1
            self.position.advance(8, 100)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Model weights and every optimizer tensor, cloned."""
        out = {f"model.{k}": v.clone() for k, v in self.model.state_dict().items()}
        for i, entries in self.opt.state_dict()["state"].items():
            out.update({f"optim.{i}.{name}": t.clone() for name, t in entries.items()})
        return out


@pytest.fixture
def saved(tmp_path, process_group):
    """A run folder with committed step-4 and step-8 checkpoints; the state at each step."""
    root, run, states = str(tmp_path / "run"), Run(seed=0), {}
    ckpt = Checkpointer(root)
    for step in (4, 8):
        run.train(4)
        states[step] = (run.tensors(), DataPosition(run.position.epoch, run.position.consumed))
        ckpt.save(step, run.state)
        assert ckpt.wait() == step
    return root, states


def restore(root: str, run: Run, candidates: list[int]) -> tuple[str, list]:
    corrupt = []
    loaded, _ = Checkpointer(root).restore(
        run.state, [step_path(root, s) for s in candidates], lambda *a: corrupt.append(a)
    )
    return loaded, corrupt


FLIPS = {  # what is damaged -> the item the error must name
    "model tensor": ("model.0.weight", "model.0.weight"),
    "optimizer tensor": ("optim.state.0.weight.exp_avg_sq", "optim.state.0.weight.exp_avg_sq"),
    "data position": ("data.pickle", "data.pickle"),
    ".metadata": (".metadata", ".metadata fails its checksum"),
}


@pytest.mark.parametrize("damaged", FLIPS)
def test_a_flipped_bit_makes_the_restore_fall_back_and_name_the_item(saved, damaged):
    root, states = saved
    fqn, named = FLIPS[damaged]
    newest = step_path(root, 8)
    flip_bit(newest, fqn)
    run = Run(seed=1)  # other weights: the load must overwrite every one
    loaded, corrupt = restore(root, run, [8, 4])
    assert loaded == step_path(root, 4)
    [(path, reason)] = corrupt
    assert path == newest and named in reason and "checksum" in reason, reason
    tensors, position = states[4]
    assert_equal(run.tensors(), tensors)
    assert run.position == position
    # verify flags exactly the damaged checkpoint and the damaged item
    [problem] = verify_checkpoint(newest)
    assert named in problem
    assert verify_checkpoint(step_path(root, 4)) == []


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_truncated_or_missing_data_file_makes_the_restore_fall_back_naming_it(saved, damage):
    """The reader's hashing thread meets the damage first (it reads ahead of DCP): its error reaches
    the restore as the named corruption, and nothing waits on a hash that never comes."""
    root, states = saved
    newest = step_path(root, 8)
    name, offset, length = stored_item(newest, "optim.state.0.weight.exp_avg_sq")
    if damage == "missing":
        os.remove(f"{newest}/{name}")
    else:  # cut inside the item: the bytes before it are intact
        os.truncate(f"{newest}/{name}", offset + length // 2)
    run = Run(seed=1)
    loaded, corrupt = restore(root, run, [8, 4])
    assert loaded == step_path(root, 4)
    [(path, reason)] = corrupt
    want = f"missing file {newest}/{name}" if damage == "missing" else f"exp_avg_sq ({name}, bytes {offset}-"
    assert path == newest and want in reason, reason
    assert_equal(run.tensors(), states[4][0])
    assert run.position == states[4][1]


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and any(k.startswith("optim.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_an_intact_checkpoint_loads_bitwise_and_verifies(saved):
    root, states = saved
    run = Run(seed=1)
    loaded, corrupt = restore(root, run, [8, 4])
    assert loaded == step_path(root, 8) and corrupt == []
    assert_equal(run.tensors(), states[8][0])
    assert run.position == states[8][1]
    record = json.loads(read(f"{loaded}/{CHECKSUM_FILE}"))
    assert record[".metadata"] == xxhash.xxh3_64_hexdigest(read(f"{loaded}/.metadata"))
    name, offset, length = stored_item(loaded, "model.0.weight")
    with open(f"{loaded}/{name}", "rb") as f:
        f.seek(offset)
        assert record["items"][name][str(offset)] == [length, xxhash.xxh3_64_hexdigest(f.read(length))]


def rewrite_metadata(path: str, drop: callable) -> None:
    """Remove entries from `.metadata` and reseal its checksum (a migration tool that rewrote both)."""
    with open(f"{path}/.metadata", "rb") as f:
        meta = pickle.load(f)
    meta.state_dict_metadata = {k: v for k, v in meta.state_dict_metadata.items() if not drop(k)}
    meta.storage_data = {i: s for i, s in meta.storage_data.items() if not drop(i.fqn)}
    data = pickle.dumps(meta)
    write(f"{path}/.metadata", data)
    record = json.loads(read(f"{path}/{CHECKSUM_FILE}"))
    record[".metadata"] = xxhash.xxh3_64_hexdigest(data)
    write(f"{path}/{CHECKSUM_FILE}", json.dumps(record).encode())


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_a_checkpoint_without_optimizer_state_is_refused_in_one_line_naming_it(saved):
    root, _ = saved
    newest = step_path(root, 8)
    rewrite_metadata(newest, lambda key: key.startswith("optim."))
    with pytest.raises(CheckpointError) as e:
        restore(root, Run(seed=1), [8])
    message = str(e.value)
    assert "\n" not in message and f"{newest}: incomplete: no 'optim' entries" in message
    assert verify_checkpoint(newest) == [f"{newest}: incomplete: no 'optim' entries"]


def test_a_missing_optimizer_entry_falls_back_naming_the_key(saved):
    root, states = saved
    newest = step_path(root, 8)
    rewrite_metadata(newest, lambda key: key == "optim.state.2.bias.exp_avg")
    run = Run(seed=1)
    loaded, [(path, reason)] = restore(root, run, [8, 4])
    assert loaded == step_path(root, 4) and path == newest
    assert reason == f"{newest}: incomplete: no 'optim.state.2.bias.exp_avg'"
    assert_equal(run.tensors(), states[4][0])


def test_a_rank_an_elastic_resize_added_may_lack_only_its_rng_entry(saved):
    root, states = saved
    run = Run(seed=1, rank=3)  # the checkpoint holds rng.rank0 only
    loaded, corrupt = restore(root, run, [8])
    assert loaded == step_path(root, 8) and corrupt == []
    assert missing_components({"rng.rank0.pickle", "rng.rank2.pickle"}, ["rng.rank1", "rng.rank3"]) == [
        "no 'rng.rank1' entries"
    ]
    saved_keys = {f"{k}.pickle" for k in COMPONENT_KEYS if k not in (KEY_MODEL, KEY_OPTIM)}
    saved_keys |= {"model.w", "optim.state.w.exp_avg", "rng.rank0.pickle"}
    assert missing_components(saved_keys) == []
    assert missing_components(saved_keys - {"data.pickle"}) == ["no 'data' entries"]
    assert missing_components(saved_keys | {"model.v"}) == ["no optimizer state for 'v'"]


def test_a_bug_in_the_restore_is_raised_not_taken_for_corruption(saved, monkeypatch):
    root, _ = saved

    def broken(self, state):
        raise TypeError("a bug")

    monkeypatch.setattr(ModelState, "load_state_dict", broken)
    corrupt = []
    with pytest.raises(TypeError, match="a bug"):
        Checkpointer(root).restore(
            Run(seed=1).state, [step_path(root, 8), step_path(root, 4)], lambda *a: corrupt.append(a)
        )
    assert corrupt == []


def test_verify_command_prints_one_row_per_checkpoint_and_fails_on_a_corrupt_one(saved, capsys):
    root, _ = saved
    assert cli.main(["verify", root]) == 0
    assert "step-4  ok" in capsys.readouterr().out
    flip_bit(step_path(root, 8), "model.2.weight")
    assert cli.main(["verify", root]) == 1
    out = capsys.readouterr().out
    assert "step-4  ok" in out and "step-8  corrupt: " in out and "model.2.weight" in out
    assert cli.main(["verify", root, "--step", "4"]) == 0
    assert "step-8" not in capsys.readouterr().out
    assert cli.main(["verify", root, "--step", "5"]) == 2
    assert "no committed checkpoint step-5" in capsys.readouterr().err


def test_every_item_carries_a_checksum_written_on_the_save_thread(saved, monkeypatch):
    # the hashing runs where DCP writes: not on the thread that called save()
    import raytrain_ft.checkpoint.integrity as integrity

    threads = set()
    real = integrity._HashingStream.write

    def write(self, b):
        threads.add(threading.current_thread().name)
        return real(self, b)

    monkeypatch.setattr(integrity._HashingStream, "write", write)
    root, _ = saved
    run = Run(seed=2)
    run.train(1)
    ckpt = Checkpointer(root)
    ckpt.save(9, run.state)
    assert ckpt.wait() == 9
    assert threads and "MainThread" not in threads


def test_checksums_on_an_object_store(tmp_path, process_group, monkeypatch):
    # the writer's hashing streams and the reader's range hashing through s3fs (a local moto server)
    import socket

    import s3fs
    from moto.server import ThreadedMotoServer

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for k, v in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    s3fs.S3FileSystem.clear_instance_cache()
    s3 = s3fs.S3FileSystem()
    s3.makedirs("integrity", exist_ok=True)
    try:
        root, run = "s3://integrity/run", Run(seed=0)
        ckpt = Checkpointer(root)
        run.train(2)
        expected = run.tensors()
        ckpt.save(2, run.state)
        assert ckpt.wait() == 2
        assert verify_checkpoint(step_path(root, 2)) == []
        other = Run(seed=1)
        assert restore(root, other, [2]) == (step_path(root, 2), [])
        assert_equal(other.tensors(), expected)
        name, offset, length = "__0_0.distcp", *stored_offset(s3, "integrity/run/step-2", "model.0.weight")
        data = bytearray(s3.cat_file(f"integrity/run/step-2/{name}"))
        data[offset + length // 2] ^= 0x10
        s3.pipe_file(f"integrity/run/step-2/{name}", bytes(data))
        [problem] = verify_checkpoint(step_path(root, 2))
        assert "model.0.weight" in problem
    finally:
        server.stop()


def stored_offset(s3, path: str, fqn: str) -> tuple[int, int]:
    meta = pickle.loads(s3.cat_file(f"{path}/.metadata"))
    [info] = [s for index, s in meta.storage_data.items() if index.fqn == fqn]
    return info.offset, info.length
