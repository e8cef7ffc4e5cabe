"""The any-world-size split: a global batch of 8 sequences (micro-batch 2) at W=3 against W=2.

Processes under torch.multiprocessing, gloo, no Ray; the `tiny` preset under DDP (vocab 512,
seq_len 256, random tokens), each step = `raytrain_ft.training.loop.forward_backward` over the rank's
`data.batches.split_passes` (W=2: 4 sequences in 2 passes of 2; W=3: 2/3/3 sequences in 2 passes), clip,
AdamW. Rounds alternate W=2 and W=3 (`--rounds`, each `--steps` timed steps after one warm-up);
reported: median step time (the slowest rank's), steps/s, sequences/s per rank, and
`batch_balance` (G / (W x largest share)). One process per rank with one thread each: on a
machine with fewer cores than 3 ranks, W=3 also measures the oversubscription (`cpu_count` in the
JSON).

Prints JSON and writes benchmarks/results/uneven_split.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from raytrain_ft.core.config_files import load_config
from raytrain_ft.data.batches import split_passes
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.model.parallel import build
from raytrain_ft.training.loop import forward_backward
from report import default_out, report, scratch, spawn_ranks

PRESET, VOCAB, SEQ_LEN, G, M = "tiny", 512, 256, 8, 2


def worker(rank: int, world_size: int, steps: int, root: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world_size)
    cfg = load_config(None, [f"model.preset={PRESET}", "parallel.strategy=ddp", "model.dropout=0.0"])
    par, optimizer = build(cfg, VOCAB, SEQ_LEN, torch.device("cpu"), resuming=False)
    plan = BatchPlan(G, M, world_size)
    tokens = torch.randint(0, VOCAB, (G, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    lanes = [
        {"tokens": tokens[j * M : (j + 1) * M], "sample_id": torch.arange(j * M, (j + 1) * M)} for j in range(G // M)
    ]
    passes = split_passes(plan, rank, [lanes[j] for j in plan.lanes(rank)])
    times = []
    for i in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        forward_backward(par, plan, passes, 1.0, torch.device("cpu"))
        par.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        if i:  # the first step allocates AdamW's state
            times.append(time.perf_counter() - t0)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, times)
    if rank == 0:
        with open(f"{root}/times.json", "w") as f:
            json.dump([max(t) for t in zip(*gathered, strict=True)], f)
    # the DDP wrapper holds the process group: freed after destroy_process_group, the gloo group's
    # destructor waited forever on its worker thread (py-spy: ~ProcessGroupGloo from ~Reducer)
    del par, optimizer
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=default_out("uneven_split"))
    args = p.parse_args()
    step_s: dict[int, list[float]] = {2: [], 3: []}
    for r in range(args.rounds):
        for w in step_s:
            root = scratch(f"uneven-{w}-{r}-")
            spawn_ranks(worker, (w, args.steps, root), w, timeout_s=300)
            with open(f"{root}/times.json") as f:
                step_s[w].append(statistics.median(json.load(f)))
    median = {w: statistics.median(t) for w, t in step_s.items()}
    plans = {w: BatchPlan(G, M, w) for w in step_s}
    report(
        {
            "preset": PRESET,
            "global_batch_size": G,
            "micro_batch_size": M,
            "seq_len": SEQ_LEN,
            "cpu_count": os.cpu_count(),
            "step_s": {f"w{w}": s for w, s in median.items()},
            "steps_per_s": {f"w{w}": 1 / s for w, s in median.items()},
            "sequences_per_s_per_rank": {f"w{w}": G / w / s for w, s in median.items()},
            "batch_balance": {f"w{w}": plans[w].batch_balance for w in plans},
            "passes": {f"w{w}": plans[w].grad_accum_steps for w in plans},
            "step_time_w3_over_w2": median[3] / median[2],
            "rounds": {f"w{w}": t for w, t in step_s.items()},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
