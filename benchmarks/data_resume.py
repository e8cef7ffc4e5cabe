"""Ray Data resume cost and loader throughput against what the `small` model consumes.

Builds a dataset of at least `--samples` samples (default 50,000: the stdlib corpus packed at
seq_len 256, its shards copied to reach the size; sized to finish in a few minutes on 2 cores.
None of the figures should grow with the dataset: a resume seeks by row-group offsets, read
amplification and row groups per batch are ratios and counts per step), then, on a local Ray
instance, for rank 0 of a 2-worker plan (global batch 64, micro-batch 8: 8 lanes):

  * time to the first micro-batch when the pipeline starts at 0 %, 50 % and 90 % of an epoch
    (target: 90 % / 0 % <= 1.1: resume reads only what remains);
  * loader throughput in tokens/s over many micro-batches, against the tokens/s one `small`
    model replica trains on this machine (target >= 5x);
  * read amplification at world sizes 1, 2 and 4: parquet bytes read by all ranks' read tasks
    over a whole epoch / bytes of the samples trained (target <= 1.1);
  * distinct row groups per global batch, for this plan and for the demo config's (global batch
    8, micro-batch 2) (targets: min(global / micro batch, 16, row groups) = 8 and 4).

Prints JSON and writes benchmarks/results/data_resume.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import time

import numpy as np
import pyarrow.parquet as pq
import ray
import torch

from raytrain_ft.data.manifest import MANIFEST, Manifest, Shard
from raytrain_ft.data.order import EpochOrder, steps_per_epoch
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.data.prepare import PrepareSettings
from raytrain_ft.launch.datasource import rank_datasource, rank_micro_batches
from raytrain_ft.launch.prepare import prepare
from raytrain_ft.model.causal_lm import build_model, lm_loss
from report import default_out, report, scratch


def big_dataset(root: str, min_samples: int) -> tuple[str, Manifest]:
    """The stdlib corpus prepared once, its shards copied until the dataset holds `min_samples`."""
    src = os.path.join(root, "stdlib")
    base = prepare(None, src, PrepareSettings(seq_len=256, vocab_size=8192)).manifest
    out = os.path.join(root, "big")
    os.makedirs(out)
    shards, first = [], 0
    while first < min_samples:
        for s in base.shards:
            name = f"copy{first:09d}-{s.file}"
            shutil.copy(os.path.join(src, s.file), os.path.join(out, name))
            shards.append(Shard(name, first, s.num_samples, s.row_group_rows))
            first += s.num_samples
    m = dataclasses.replace(base, num_samples=first, fingerprint="bench", shards=shards)
    with open(os.path.join(out, MANIFEST), "w") as f:
        f.write(m.to_json())
    return out, m


def compressed_bytes(row_group: pq.RowGroupMetaData) -> int:
    """Bytes of a row group in its file: the sum of its column chunks' compressed sizes."""
    return sum(row_group.column(c).total_compressed_size for c in range(row_group.num_columns))


def read_amplification(path: str, m: Manifest, global_batch_size: int, micro_batch_size: int, world_size: int):
    """Parquet bytes read by all ranks over an epoch / bytes of the samples they train.

    Runs every rank's Ray Data read tasks (`rank_datasource`) in this process and counts the
    compressed bytes of each `read_row_group` call; a trained sample weighs its row group's
    compressed bytes / rows.
    """
    weight = []
    for s in m.shards:
        meta = pq.ParquetFile(os.path.join(path, s.file)).metadata
        weight += [np.full(n, compressed_bytes(meta.row_group(g)) / n) for g, n in enumerate(s.row_group_rows)]
    weight = np.concatenate(weight)
    read_bytes, trained_bytes = 0, 0.0
    real = pq.ParquetFile.read_row_group

    def counted(f, i, **kw):
        nonlocal read_bytes
        read_bytes += compressed_bytes(f.metadata.row_group(i))
        return real(f, i, **kw)

    plan = BatchPlan(global_batch_size, micro_batch_size, world_size)
    steps = steps_per_epoch(m, global_batch_size, micro_batch_size)
    pq.ParquetFile.read_row_group = counted
    try:
        for rank in range(world_size):
            for task in rank_datasource(path, m, 0, 0, 0, steps, plan, rank).get_read_tasks(1):
                for block in task():
                    trained_bytes += weight[block.column("sample_id").to_numpy()].sum()
    finally:
        pq.ParquetFile.read_row_group = real
    return read_bytes / trained_bytes


def distinct_row_groups(path: str, m: Manifest, global_batch_size: int, micro_batch_size: int, steps: int) -> dict:
    """Distinct row groups per global batch over the first `steps` steps of epoch 0: min and mean."""
    group_of = np.concatenate([np.full(n, k) for k, n in enumerate(n for s in m.shards for n in s.row_group_rows)])
    order = EpochOrder(path, m, 0, 0, global_batch_size, micro_batch_size)
    ids = order.step_sample_ids(0, min(steps, order.steps))
    distinct = [len(np.unique(group_of[step])) for step in ids]
    return {"min": int(min(distinct)), "mean": float(np.mean(distinct))}


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
    n = sum(b["tokens"].size for _, b in zip(range(batches), it, strict=False))
    return n / (time.perf_counter() - t0)


def model_tokens_per_s(vocab: int, micro: int) -> float:
    torch.manual_seed(0)
    model = build_model("small", vocab, 256)
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
    p.add_argument("--samples", type=int, default=50_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=default_out("data_resume"))
    args = p.parse_args()
    path, m = big_dataset(scratch("data-bench-"), args.samples)
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
    amplification = {str(w): read_amplification(path, m, 64, 8, w) for w in (1, 2, 4)}
    mixing = {
        "global_batch_64_micro_8": distinct_row_groups(path, m, 64, 8, 300),
        "demo_global_batch_8_micro_2": distinct_row_groups(path, m, 8, 2, 300),
    }
    result = {
        "num_samples": m.num_samples,
        "seq_len": m.seq_len,
        "time_to_first_batch_s": ttfb,
        "ratio_90_over_0": ttfb["90%"] / ttfb["0%"],
        "loader_tokens_per_s": loader,
        "small_model_tokens_per_s": model,
        "loader_over_model": loader / model,
        "read_amplification_by_world_size": amplification,
        "distinct_row_groups_per_global_batch": mixing,
        "targets": {
            "ratio_90_over_0": 1.1,
            "loader_over_model": 5.0,
            "read_amplification": 1.1,
            "distinct_row_groups": {"global_batch_64_micro_8": 8, "demo_global_batch_8_micro_2": 4},
        },
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
