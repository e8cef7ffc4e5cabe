"""FSDP against DDP on 2 gloo ranks: state bytes per rank, step time, and the async-save stall under FSDP.

Two processes (torch.multiprocessing, gloo, no Ray), the `small` preset (vocab 8192, seq_len 256,
random tokens, micro-batch 2, one micro-batch per step) built by `raytrain_ft.model.parallel.build` under
`ddp` and under `fsdp`, both alive in each process. Side by side in one run:

1. bytes per rank of parameters + gradients + AdamW state (local shards), after one step;
   target FSDP/DDP <= 0.55 at 2 ranks;
2. step time (forward/backward, clip, AdamW step), median over `--rounds` rounds of `--steps`
   steps, rounds alternating ddp and fsdp; FSDP/DDP reported, target <= 1.3 on CPU;
3. under FSDP, the training stall of an async save with `raytrain_ft.checkpoint.checkpointer.Checkpointer`
   (`save()` + one forward/backward it overlaps with + `wait_staged()`, the forward/backward not
   counted) against a synchronous `dcp.save` of the same sharded state, median of `--repeats`
   after one warm-up save; target <= 0.05.

Prints JSON and writes benchmarks/results/sharding.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.train_state import KEY_MODEL, KEY_OPTIM, ModelState, OptimizerState, TrainState
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.run_folder import step_path
from raytrain_ft.model.causal_lm import lm_loss
from raytrain_ft.model.parallel import build, local
from report import default_out, report, scratch, spawn_ranks

PRESET, VOCAB, SEQ_LEN, MICRO_BATCH = "small", 8192, 256, 2
WORLD_SIZE = 2


def state_bytes(par, optimizer) -> int:
    params = list(par.model.parameters())
    optim = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum(local(t).numel() * t.element_size() for t in params + [p.grad for p in params] + optim)


def worker(rank: int, args, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=WORLD_SIZE)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(rank))
    built = {}
    for strategy in ("ddp", "fsdp"):
        cfg = load_config(None, [f"model.preset={PRESET}", f"parallel.strategy={strategy}"])
        built[strategy] = build(cfg, VOCAB, SEQ_LEN, torch.device("cpu"), resuming=False)

    def forward_backward(par) -> None:
        with par.micro_batch(last=True):
            lm_loss(par.forward_module, tokens).backward()

    def step(par, optimizer) -> None:
        forward_backward(par)
        par.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = {"bytes": {}, "step_s": {"ddp": [], "fsdp": []}}
    for strategy, (par, optimizer) in built.items():
        forward_backward(par)
        optimizer.step()
        result["bytes"][strategy] = state_bytes(par, optimizer)
        optimizer.zero_grad(set_to_none=True)
    for _ in range(args.rounds):
        for strategy, (par, optimizer) in built.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(par, optimizer)
            dist.barrier()
            result["step_s"][strategy].append((time.perf_counter() - t0) / args.steps)

    par, optimizer = built["fsdp"]
    state = TrainState(rank)
    state.add(KEY_MODEL, ModelState(par.model))
    state.add(KEY_OPTIM, OptimizerState(par.model, optimizer))
    checkpointer = Checkpointer(root)
    stalls, syncs = [], []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        checkpointer.save(i, state)
        t_saved = time.perf_counter()
        forward_backward(par)  # the work the snapshot copy overlaps with
        t_work = time.perf_counter()
        checkpointer.wait_staged()
        stall = (t_saved - t0) + (time.perf_counter() - t_work)
        checkpointer.wait()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state.snapshot(), checkpoint_id=f"{step_path(root, i)}-sync", process_group=checkpointer.save_group)
        dist.barrier()
        if i > 0:  # the first save allocates the staging buffers
            stalls.append(stall)
            syncs.append(time.perf_counter() - t0)
    result.update(stall_s=stalls, sync_s=syncs)
    gathered = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=default_out("sharding"))
    args = p.parse_args()
    root = scratch("sharding-bench-")
    raw = os.path.join(root, "raw.json")
    spawn_ranks(worker, (args, root, raw), WORLD_SIZE, timeout_s=1800)
    with open(raw) as f:
        ranks = json.load(f)
    bytes_ratio = max(r["bytes"]["fsdp"] / r["bytes"]["ddp"] for r in ranks)
    step = {
        s: statistics.median(max(r["step_s"][s][i] for r in ranks) for i in range(args.rounds)) for s in ("ddp", "fsdp")
    }
    stall = statistics.median(max(r["stall_s"][i] for r in ranks) for i in range(args.repeats))
    sync = statistics.median(max(r["sync_s"][i] for r in ranks) for i in range(args.repeats))
    report(
        {
            "preset": PRESET,
            "world_size": WORLD_SIZE,
            "micro_batch_size": MICRO_BATCH,
            "seq_len": SEQ_LEN,
            "state_bytes_per_rank": {s: [r["bytes"][s] for r in ranks] for s in ("ddp", "fsdp")},
            "state_bytes_fsdp_over_ddp": bytes_ratio,
            "step_s": step,
            "step_time_fsdp_over_ddp": step["fsdp"] / step["ddp"],
            "fsdp_async_stall_s": stall,
            "fsdp_sync_save_s": sync,
            "stall_over_sync": stall / sync,
            "per_rank": ranks,
            "targets": {"state_bytes_fsdp_over_ddp": 0.55, "step_time_fsdp_over_ddp": 1.3, "stall_over_sync": 0.05},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
