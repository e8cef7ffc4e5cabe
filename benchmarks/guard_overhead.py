"""Steps/s of the full training step (guards, straggler timing, MLflow, fingerprints, a save) against the bare DDP step.

Two gloo ranks (torch.multiprocessing, no Ray: `raytrain_ft.training.local_session.LocalSession`), the
`small` preset on the stdlib corpus (prepared into data/stdlib if missing). Each rank builds one
`Trainer`. A round runs `--steps` bare steps (forward/backward, clip, AdamW; nothing else) and
`--steps` full steps (`Trainer.step`: spike guard and its all-reduce, rank check every 10 steps, a
replica fingerprint every 5, the straggler detector's compute timer and judgement, MLflow metrics
every step, and, with `--saves-per-round 1` (the default), one asynchronous checkpoint per round,
started at the round's first full step, whose write must finish inside the round; with 0 no save,
so the ratio is the guards' and the straggler measurement's alone, the checkpoint's own cost being
`checkpoint_stall.py`'s). The order of
the two variants is drawn per round (seeded), so neither always runs first on a warm or a cold
machine. Each round gives one paired ratio (full / bare steps/s); rounds continue until the 95 %
confidence half-width of the mean ratio (Student t) is below `--resolve` (0.01) or `--max-rounds`.
The first `--warmup-rounds` (2) rounds run both variants the same way but are reported apart
(`warmup_rounds`) and never counted: the full step's first rounds after the 9 warm-up steps run
well below the later ones (the first rounds' MLflow writes and allocator growth).
Target: full/bare >= 0.97, with a half-width smaller than that 3 % effect. Prints JSON and writes
benchmarks/results/guard_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time

import torch
import torch.distributed as dist
from scipy import stats

from raytrain_ft.core.config_files import load_config
from raytrain_ft.data.position import Share
from raytrain_ft.data.prepare import PrepareSettings
from raytrain_ft.launch.prepare import prepare
from raytrain_ft.telemetry.tracking import start_or_resume_run
from raytrain_ft.training.local_session import LocalSession
from raytrain_ft.training.loop import Trainer, forward_backward
from raytrain_ft.training.run_components import RunComponents
from report import default_out, report, scratch, spawn_ranks


def bare_step(c: RunComponents) -> None:
    passes = c.batches.take(c.position, Share(c.plan, c.rank))  # the position stays: the same batch each call
    forward_backward(c.par, c.plan, passes, 1.0, c.device)
    c.par.clip_grad_norm_(c.cfg.train.grad_clip)
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)


def worker(rank: int, args, cfg, uri: str, run_id: str, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    session = LocalSession(os.path.join(cfg.run.storage_path, cfg.run.name), cfg.data.path, 0, uri, run_id)
    t = Trainer(RunComponents(cfg, session))
    t.begin()
    for _ in range(args.steps - 1):  # warm-up, and the next full round starts at a checkpoint step
        t.step()
    if args.saves_per_round:
        t.c.commits.after_commit(t.c.checkpointer.wait())

    rng = random.Random(0)  # the same draws on both ranks
    rounds, stop = [], torch.zeros(1)
    while not stop.item():
        order = [("bare", lambda: bare_step(t.c)), ("full", t.step)]
        rng.shuffle(order)
        steps_per_s = {}
        for name, runner in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runner()
            if name == "full" and args.saves_per_round:
                # the round's save is charged to its round, never to the next
                t.c.commits.after_commit(t.c.checkpointer.wait())
            dist.barrier()
            steps_per_s[name] = args.steps / (time.perf_counter() - t0)
        rounds.append({"first": order[0][0], **steps_per_s, "ratio": steps_per_s["full"] / steps_per_s["bare"]})
        if rank == 0:
            n = len(rounds) - args.warmup_rounds
            stop[0] = n >= args.max_rounds or (
                n >= args.min_rounds and half_width(rounds[args.warmup_rounds :]) < args.resolve
            )
        dist.broadcast(stop, src=0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rounds, f)
    dist.destroy_process_group()


def half_width(rounds: list[dict]) -> float:
    """95 % confidence half-width of the mean paired ratio (Student t, n - 1 degrees of freedom)."""
    ratios = [r["ratio"] for r in rounds]
    return float(stats.t.ppf(0.975, len(ratios) - 1) * statistics.stdev(ratios) / math.sqrt(len(ratios)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="steps per variant per round")
    p.add_argument("--warmup-rounds", type=int, default=2, help="rounds run first and not counted")
    p.add_argument("--min-rounds", type=int, default=10)
    p.add_argument("--max-rounds", type=int, default=60)
    p.add_argument("--resolve", type=float, default=0.01, help="stop once the ratio's 95%% half-width is below this")
    p.add_argument("--saves-per-round", type=int, choices=(0, 1), default=1, help="0: no checkpoint in the rounds")
    p.add_argument("--data", default="data/stdlib")
    p.add_argument("--out", default=default_out("guard_overhead"))
    args = p.parse_args()
    prepare(None, args.data, PrepareSettings())
    tmp = scratch("guard-bench-")
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
            f"checkpoint.interval_steps={args.steps if args.saves_per_round else 10**9}",
            "guards.fingerprint.interval_steps=5",
        ],
    )
    uri = f"sqlite:///{tmp}/mlflow.db"
    run_id = start_or_resume_run(uri, "bench", os.path.join(tmp, "bench"), "bench", {})
    raw = os.path.join(tmp, "raw.json")
    spawn_ranks(worker, (args, cfg, uri, run_id, os.path.join(tmp, "store"), raw), 2, timeout_s=7200)
    with open(raw) as f:
        measured = json.load(f)
    warmup, rounds = measured[: args.warmup_rounds], measured[args.warmup_rounds :]
    ratio = statistics.mean(r["ratio"] for r in rounds)
    result = {
        "preset": "small",
        "world_size": 2,
        "global_batch_size": 4,
        "seq_len": 256,
        "steps_per_round": args.steps,
        "rounds": len(rounds),
        "saves_per_round": args.saves_per_round,
        "fingerprint_interval_steps": 5,
        "bare_steps_per_s": statistics.median(r["bare"] for r in rounds),
        "full_steps_per_s": statistics.median(r["full"] for r in rounds),
        "full_over_bare": ratio,
        "full_over_bare_95ci_half_width": half_width(rounds),
        "full_first_rounds": sum(r["first"] == "full" for r in rounds),
        "per_round": rounds,
        "warmup_rounds": warmup,
        "target": 0.97,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
