"""Training stall of an async checkpoint against a synchronous save and a plain in-memory copy, and the
cost of checkpoint checksums (`raytrain_ft.checkpoint.integrity`) on the save and on the restore.

One process (world size 1, gloo; NCCL and a GPU when present), the `125m` preset (~98M parameters
with vocab 8192) with AdamW state after one step. Measured side by side, median of `--repeats`,
each with checksums (the project's writer and reader) and without (DCP's plain fsspec writer and
reader and default load planner, as before checksums):

  (a) stall: what the training loop waits for with `raytrain_ft.checkpoint.checkpointer.Checkpointer`: the
      `async_save` call, then one forward/backward (real work the copy overlaps with), then
      `wait_staged()` before the optimizer step. Also reported: the stall without overlap.
  (b) sync: `dcp.save` of the same state dict.
  (c) copy: one clone of every tensor of the state dict (the physical floor for a snapshot).
  (d) restore: `Checkpointer.restore` of the last checkpoint into the live state (page cache warm),
      with torch's default intra-op threads (every core) and with one (a CPU training worker's:
      the checksum thread then has a core of its own).

Prints a JSON summary and writes it to benchmarks/results/checkpoint_stall.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from raytrain_ft.checkpoint import checkpointer as checkpoint
from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.integrity import ChecksummedWriter
from raytrain_ft.checkpoint.train_state import KEY_META, ModelState, OptimizerState, RunMeta, TrainState
from raytrain_ft.core.run_folder import step_path
from raytrain_ft.model.causal_lm import build_model, lm_loss
from report import default_out, report, scratch


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="125m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=default_out("checkpoint_stall"))
    args = p.parse_args()
    root = scratch("ckpt-bench-")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{root}/store", rank=0, world_size=1)

    torch.manual_seed(0)
    model = build_model(args.preset, 8192, 128).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 8192, (1, 129), device=device)

    def train_step_work():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            lm_loss(model, tokens).backward()

    train_step_work()
    optimizer.step()
    state = TrainState(rank=0)
    state.add("model", ModelState(model))
    state.add("optim", OptimizerState(model, optimizer))
    state.add(KEY_META, RunMeta({}))
    num_params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3  # weights + m + v

    arms = {"checksums": ChecksummedWriter, "no_checksums": FsspecWriter}
    checkpointers = {arm: Checkpointer(f"{root}/{arm}") for arm in arms}
    rounds: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for i in range(args.repeats + 1):  # the first round warms up (allocates the staging buffers)
        for arm, writer in arms.items():  # interleaved: a load change on the shared machine hits both arms
            with contextlib.ExitStack() as plain:
                if writer is FsspecWriter:  # the checkpointer's writer, reader and planner as before checksums
                    plain.enter_context(mock.patch.object(checkpoint, "ChecksummedWriter", FsspecWriter))
                    plain.enter_context(mock.patch.object(checkpoint, "ChecksummedReader", FsspecReader))
                    plain.enter_context(
                        mock.patch.object(checkpoint, "CompleteLoadPlanner", lambda path: DefaultLoadPlanner())
                    )
                times = one_round(checkpointers[arm], f"{root}/{arm}", i, state, train_step_work, writer, cuda)
            if i:
                rounds[arm].append(times)
    m = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for arm, rs in rounds.items()}
    c, n = m["checksums"], m["no_checksums"]
    result = {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)",
        "preset": args.preset,
        "num_params": num_params,
        "state_bytes": state_bytes,
        "repeats": args.repeats,
        "stall_s": c["stall"],
        "stall_without_overlap_s": c["stall_no_overlap"],
        "sync_save_s": c["sync"],
        "copy_s": c["copy"],
        "restore_s": c["restore"],
        "restore_one_thread_s": c["restore_one_thread"],
        "stall_over_sync": c["stall"] / c["sync"],
        "stall_over_copy": c["stall"] / c["copy"],
        "stall_without_overlap_over_copy": c["stall_no_overlap"] / c["copy"],
        "no_checksums": {
            "stall_s": n["stall"],
            "sync_save_s": n["sync"],
            "restore_s": n["restore"],
            "restore_one_thread_s": n["restore_one_thread"],
            "stall_over_sync": n["stall"] / n["sync"],
        },
        "sync_save_checksums_over_none": c["sync"] / n["sync"],
        "restore_checksums_over_none": c["restore"] / n["restore"],
        "restore_one_thread_checksums_over_none": c["restore_one_thread"] / n["restore_one_thread"],
        "targets": {"stall_over_sync": 0.05, "stall_over_copy": 1.5, "restore_checksums_over_none": 1.15},
    }
    report(result, args.out)
    dist.destroy_process_group()


def one_round(ckpt: Checkpointer, root: str, i: int, state: TrainState, work, writer, cuda: bool) -> dict[str, float]:
    """Seconds of one round: the async stall (with and without overlap), the sync save, the copy, the restore.
    Deletes its checkpoints afterwards (1.2 GB each at 125m)."""
    t0 = time.perf_counter()
    ckpt.save(2 * i, state)
    returned = time.perf_counter() - t0
    work()
    stall = returned + timed(ckpt.wait_staged)
    ckpt.wait()
    t0 = time.perf_counter()
    ckpt.save(2 * i + 1, state)
    ckpt.wait_staged()
    no_overlap = time.perf_counter() - t0
    ckpt.wait()
    sync = timed(lambda: dcp.save(state.snapshot(), storage_writer=writer(step_path(root, 1000 + i))))
    if cuda:
        torch.cuda.synchronize()
    copy = timed(lambda: [t.clone() for t in _tensors(state.snapshot())])
    restore = timed(lambda: ckpt.restore(state, [step_path(root, 2 * i + 1)], print))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a training worker's setting on CPU (Ray sets OMP_NUM_THREADS to its CPUs: 1 here)
    try:
        restore_one_thread = timed(lambda: ckpt.restore(state, [step_path(root, 2 * i + 1)], print))
    finally:
        torch.set_num_threads(threads)
    for step in (2 * i, 2 * i + 1, 1000 + i):
        shutil.rmtree(step_path(root, step))
    return {
        "stall": stall,
        "stall_no_overlap": no_overlap,
        "sync": sync,
        "copy": copy,
        "restore": restore,
        "restore_one_thread": restore_one_thread,
    }


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


if __name__ == "__main__":
    main()
