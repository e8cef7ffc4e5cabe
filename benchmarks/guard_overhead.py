"""Steps/s with every guard and MLflow tracking on, against the bare DDP step, side by side.

Two gloo ranks (torch.multiprocessing, no Ray: `raytrain_ft.local_session.LocalSession`), the
`small` preset on the stdlib corpus (prepared into data/stdlib if missing). Each rank builds one
`Trainer`; rounds alternate `--steps` bare steps (forward/backward, clip, AdamW; nothing else)
with `--steps` full steps (`Trainer.step`: spike guard and its all-reduce, rank check every 10
steps, replica checksum every 50, MLflow metrics every step, fault/checkpoint bookkeeping; no
checkpoint is due). Target: guarded/bare steps/s >= 0.97. Prints JSON and writes
benchmarks/results/guard_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrain_ft.config import load_config
from raytrain_ft.data.prepare import PrepareSettings, prepare
from raytrain_ft.local_session import LocalSession
from raytrain_ft.loop import Trainer
from raytrain_ft.tracking import start_or_resume_run
from report import default_out, report


def bare_step(t: Trainer) -> None:
    micro_batches = next(t.batches)
    t.forward_backward(micro_batches, 1.0)
    t.par.clip_grad_norm_(t.cfg.train.grad_clip)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


def worker(rank: int, args, cfg, uri: str, run_id: str, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    t = Trainer(cfg, LocalSession(os.path.join(cfg.run.storage_path, cfg.run.name), cfg.data.path, 0), uri, run_id)
    bare, guarded = [], []
    for _ in range(args.rounds):
        for runner, times in ((lambda: bare_step(t), bare), (t.step, guarded)):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runner()
            dist.barrier()
            times.append(args.steps / (time.perf_counter() - t0))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bare": bare, "guarded": guarded}, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--data", default="data/stdlib")
    p.add_argument("--out", default=default_out("guard_overhead"))
    args = p.parse_args()
    prepare(None, args.data, PrepareSettings())
    tmp = tempfile.mkdtemp(prefix="guard-bench-")
    cfg = load_config(
        None,
        [
            f"data.path={os.path.abspath(args.data)}",
            f"run.storage_path={tmp}",
            "run.name=bench",
            "model.preset=small",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "train.max_steps=100000",
            "checkpoint.interval_steps=100000",
        ],
    )
    uri = f"sqlite:///{tmp}/mlflow.db"
    run_id = start_or_resume_run(uri, "bench", os.path.join(tmp, "bench"), "bench", {})
    raw = os.path.join(tmp, "raw.json")
    mp.spawn(worker, args=(args, cfg, uri, run_id, os.path.join(tmp, "store"), raw), nprocs=2)
    with open(raw) as f:
        times = json.load(f)
    bare, guarded = statistics.median(times["bare"]), statistics.median(times["guarded"])
    result = {
        "preset": "small",
        "world_size": 2,
        "global_batch_size": 4,
        "seq_len": 256,
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "bare_steps_per_s": bare,
        "guarded_steps_per_s": guarded,
        "guarded_over_bare": guarded / bare,
        "per_round": times,
        "target": 0.97,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
