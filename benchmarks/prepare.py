"""Preparation on Ray Data: tokens/s with 1 and 2 Ray workers, peak RSS for a 1x and a 3x corpus.

The corpus is the running Python's standard library sources as jsonl.gz files of 100 documents
(1x: `--files` sources picked evenly, about 5M tokens; 3x: three copies of them), tokenized with
one tokenizer.json trained beforehand, so every run does the same work per document. Each
measurement is a fresh process with its own local Ray instance (`num_cpus` = Ray workers for the
tokenize-and-pack tasks), its workers started with `RAYON_NUM_THREADS=1`: the tokenizers library
otherwise runs a thread per core inside every task, so one Ray worker already used both cores of
this machine and 1 vs 2 workers compared nothing (measured: 0.99x). Peak RSS is Linux's `VmHWM`
of the driver and of every Ray worker process, sampled every 0.2 s until the run ends (the largest
worker is reported); the object store's shared memory is not in it. Scale: a few MB of text on
2 cores; what carries over to a real corpus is the trend (RSS flat from 1x to 3x), not the
absolute tokens/s. Targets: 3x/1x peak RSS <= 1.3 for the driver and the workers.

Prints JSON and writes benchmarks/results/prepare.json.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
import sysconfig
import threading
import time

from report import default_out, report, scratch

DOCS_PER_FILE = 100


def peak_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    except (OSError, StopIteration):
        return 0.0


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            continue
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def is_ray_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::")
    except OSError:
        return False


def child(args) -> None:
    """One measurement in this process: prepare, sample the workers' peak RSS, print JSON."""
    import ray

    from raytrain_ft.data.prepare import PrepareSettings
    from raytrain_ft.launch.prepare import prepare

    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"RAYON_NUM_THREADS": "1"}},  # one thread per worker (module doc)
    )
    workers: dict[int, float] = {}
    done = threading.Event()

    def sample():
        while not done.wait(0.2):
            for pid in descendants(os.getpid()):
                if is_ray_worker(pid):
                    workers[pid] = max(workers.get(pid, 0.0), peak_rss_mb(pid))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    settings = PrepareSettings(seq_len=256, tokenizer=args.tokenizer, rows_per_row_group=512)
    t0 = time.perf_counter()
    result = prepare(args.input, args.output, settings)
    wall = time.perf_counter() - t0
    done.set()
    thread.join()
    ray.shutdown()
    m = result.manifest
    print(
        json.dumps(
            {
                "tokens": m.tokens,
                "documents": m.documents,
                "samples": m.num_samples,
                "dropped_fraction": m.dropped_tokens / m.tokens,
                "wall_s": wall,
                "tokens_per_s": m.tokens / wall,
                "driver_peak_rss_mb": peak_rss_mb(os.getpid()),
                "worker_peak_rss_mb": max(workers.values(), default=0.0),
            }
        )
    )


def write_corpus(folder: str, sources: list[str], copies: int) -> None:
    os.makedirs(folder, exist_ok=True)
    for copy in range(copies):
        for k in range(0, len(sources), DOCS_PER_FILE):
            with gzip.open(f"{folder}/part-{copy}-{k // DOCS_PER_FILE:05d}.jsonl.gz", "wt") as f:
                for path in sources[k : k + DOCS_PER_FILE]:
                    with open(path, encoding="utf-8", errors="replace") as src:
                        f.write(json.dumps({"text": src.read()}) + "\n")


def measure(corpus: str, tokenizer: str, num_cpus: int, out: str) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--child", "--input", corpus, "--output", out, "--tokenizer", tokenizer]
        + ["--num-cpus", str(num_cpus)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=1200, help="standard-library sources in the 1x corpus")
    p.add_argument("--out", default=default_out("prepare"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--input", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--num-cpus", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    from raytrain_ft.data.prepare import file_documents, train_tokenizer

    root = scratch("prepare-bench-")
    stdlib = sysconfig.get_paths()["stdlib"]
    sources = sorted(p for p in glob.glob(f"{stdlib}/**/*.py", recursive=True) if "site-packages" not in p)
    sources = sources[:: max(1, len(sources) // args.files)][: args.files]
    write_corpus(f"{root}/x1", sources, 1)
    write_corpus(f"{root}/x3", sources, 3)
    tokenizer = f"{root}/tokenizer.json"
    docs = [d for f in sorted(glob.glob(f"{root}/x1/*.jsonl.gz")) for d in file_documents(f)]
    train_tokenizer(docs, 8192).save(tokenizer)
    one = measure(f"{root}/x1", tokenizer, 1, f"{root}/out-1")
    two = measure(f"{root}/x1", tokenizer, 2, f"{root}/out-2")
    three = measure(f"{root}/x3", tokenizer, 2, f"{root}/out-3")
    result = {
        "corpus_1x": {"files": len(sources), "documents": one["documents"], "tokens": one["tokens"]},
        "tokens_per_s": {"1_worker": one["tokens_per_s"], "2_workers": two["tokens_per_s"]},
        "speedup_2_over_1": two["tokens_per_s"] / one["tokens_per_s"],
        "dropped_fraction": one["dropped_fraction"],
        "peak_rss_mb": {
            "driver": {"1x": two["driver_peak_rss_mb"], "3x": three["driver_peak_rss_mb"]},
            "worker": {"1x": two["worker_peak_rss_mb"], "3x": three["worker_peak_rss_mb"]},
        },
        "rss_ratio_3x_over_1x": {
            "driver": three["driver_peak_rss_mb"] / two["driver_peak_rss_mb"],
            "worker": three["worker_peak_rss_mb"] / two["worker_peak_rss_mb"],
        },
        "runs": {"1x_1_worker": one, "1x_2_workers": two, "3x_2_workers": three},
        "targets": {"rss_ratio_3x_over_1x": 1.3},
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
