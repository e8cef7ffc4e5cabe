"""Ray Data resume cost and loader throughput against what the `small` model consumes.

Builds a >= 200k-sample dataset (the stdlib corpus packed at seq_len 256, its samples tiled to
reach the size), then, on a local Ray instance, for rank 0 of a 2-worker plan:

  * time to the first micro-batch when the pipeline starts at 0 %, 50 % and 90 % of an epoch
    (target: 90 % / 0 % <= 1.1: resume reads only what remains);
  * loader throughput in tokens/s over many micro-batches, against the tokens/s one `small`
    model replica trains on this machine (target >= 5x).

Prints JSON and writes benchmarks/results/data_resume.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import ray
import torch

from raytrain_ft.data.manifest import Manifest
from raytrain_ft.data.order import steps_per_epoch
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.data.prepare import PrepareSettings, prepare, write_shards
from raytrain_ft.launch.datasource import rank_micro_batches
from raytrain_ft.model import build_model, lm_loss
from report import default_out, report


def big_dataset(root: str, min_samples: int) -> tuple[str, Manifest]:
    base, _ = prepare(None, os.path.join(root, "stdlib"), PrepareSettings(seq_len=256, vocab_size=8192))
    src = os.path.join(root, "stdlib")
    rows = np.concatenate(
        [
            np.stack(pq.read_table(f"{src}/{s.file}").column("tokens").to_numpy(zero_copy_only=False))
            for s in base.shards
        ]
    )
    tiled = np.concatenate([rows] * (min_samples // len(rows) + 1))[:min_samples]
    out = os.path.join(root, "big")
    os.makedirs(out, exist_ok=True)
    import fsspec

    shards = write_shards(fsspec.filesystem("file"), out, tiled.astype(np.int32), 512)
    m = Manifest(len(tiled), 256, base.vocab_size, base.eos_token_id, base.tokenizer_file, "bench", shards)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        f.write(m.to_json())
    return out, m


def first_batch_s(path, m, plan, start) -> float:
    end = steps_per_epoch(m, plan.global_batch_size, plan.micro_batch_size)
    t0 = time.perf_counter()
    it = rank_micro_batches(path, m, 0, 0, start, end, plan, rank=0)
    next(it)
    return time.perf_counter() - t0


def loader_tokens_per_s(path, m, plan, batches: int) -> float:
    end = steps_per_epoch(m, plan.global_batch_size, plan.micro_batch_size)
    it = rank_micro_batches(path, m, 0, 0, 0, end, plan, rank=0)
    next(it)  # pipeline start-up is measured above
    t0 = time.perf_counter()
    n = sum(b["tokens"].numel() for _, b in zip(range(batches), it, strict=False))
    return n / (time.perf_counter() - t0)


def model_tokens_per_s(vocab: int, micro: int) -> float:
    torch.manual_seed(0)
    model = build_model("small", vocab, 256, 0.0)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, vocab, (micro, 257))
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        lm_loss(model, tokens).backward()
        opt.step(), opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return micro * 256 / statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=200_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=default_out("data_resume"))
    args = p.parse_args()
    path, m = big_dataset(tempfile.mkdtemp(prefix="data-bench-"), args.samples)
    plan = BatchPlan(global_batch_size=64, micro_batch_size=8, world_size=2)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    steps = steps_per_epoch(m, plan.global_batch_size, plan.micro_batch_size)
    starts = {f"{pct}%": steps * pct // 100 for pct in (0, 50, 90)}
    first_batch_s(path, m, plan, 0)  # warm-up: Ray Data's first pipeline in a process starts its executor
    samples: dict[str, list[float]] = {k: [] for k in starts}
    for _ in range(args.repeats):  # interleaved, so drift affects every start position alike
        for k, s in starts.items():
            samples[k].append(first_batch_s(path, m, plan, s))
    ttfb = {k: statistics.median(v) for k, v in samples.items()}
    loader = loader_tokens_per_s(path, m, plan, batches=1500)
    model = model_tokens_per_s(m.vocab_size, plan.micro_batch_size)
    ray.shutdown()
    result = {
        "num_samples": m.num_samples,
        "seq_len": m.seq_len,
        "time_to_first_batch_s": ttfb,
        "ratio_90_over_0": ttfb["90%"] / ttfb["0%"],
        "loader_tokens_per_s": loader,
        "small_model_tokens_per_s": model,
        "loader_over_model": loader / model,
        "targets": {"ratio_90_over_0": 1.1, "loader_over_model": 5.0},
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
