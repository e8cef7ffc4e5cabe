"""Training stall of an async checkpoint against a synchronous save and a plain in-memory copy.

One process (world size 1, gloo; NCCL and a GPU when present), the `125m` preset (~98M parameters
with vocab 8192) with AdamW state after one step. Measured side by side, median of `--repeats`:

  (a) stall: what the training loop waits for with `raytrain_ft.checkpoint.Checkpointer`: the
      `async_save` call, then one forward/backward (real work the copy overlaps with), then
      `wait_staged()` before the optimizer step. Also reported: the stall without overlap.
  (b) sync: `dcp.save` of the same state dict.
  (c) copy: one clone of every tensor of the state dict (the physical floor for a snapshot).

Prints a JSON summary and writes it to benchmarks/results/checkpoint_stall.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from raytrain_ft.checkpoint import Checkpointer, step_path
from raytrain_ft.model import build_model, lm_loss
from raytrain_ft.train_state import ModelState, OptimizerState, TrainState
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
    model = build_model(args.preset, 8192, 128, 0.0).to(device)
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
    num_params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3  # weights + m + v

    ckpt = Checkpointer(root, lambda step, path: None)
    stall, stall_no_overlap, sync, copy = [], [], [], []
    for i in range(args.repeats + 1):  # the first round warms up (allocates the staging buffers)
        t0 = time.perf_counter()
        ckpt.save(2 * i, state)
        returned = time.perf_counter() - t0
        train_step_work()
        stall_i = returned + timed(ckpt.wait_staged)
        ckpt.wait()
        t0 = time.perf_counter()
        ckpt.save(2 * i + 1, state)
        ckpt.wait_staged()
        no_overlap_i = time.perf_counter() - t0
        ckpt.wait()
        sync_i = timed(lambda i=i: dcp.save(state.snapshot(), checkpoint_id=step_path(root, 1000 + i)))
        if cuda:
            torch.cuda.synchronize()
        copy_i = timed(lambda: [t.clone() for t in _tensors(state.snapshot())])
        if i:
            stall.append(stall_i), stall_no_overlap.append(no_overlap_i), sync.append(sync_i), copy.append(copy_i)

    m = {
        k: statistics.median(v)
        for k, v in dict(stall=stall, stall_no_overlap=stall_no_overlap, sync=sync, copy=copy).items()
    }
    result = {
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores)",
        "preset": args.preset,
        "num_params": num_params,
        "state_bytes": state_bytes,
        "repeats": args.repeats,
        "stall_s": m["stall"],
        "stall_without_overlap_s": m["stall_no_overlap"],
        "sync_save_s": m["sync"],
        "copy_s": m["copy"],
        "stall_over_sync": m["stall"] / m["sync"],
        "stall_over_copy": m["stall"] / m["copy"],
        "stall_without_overlap_over_copy": m["stall_no_overlap"] / m["copy"],
        "targets": {"stall_over_sync": 0.05, "stall_over_copy": 1.5},
    }
    report(result, args.out)
    dist.destroy_process_group()


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)


if __name__ == "__main__":
    main()
