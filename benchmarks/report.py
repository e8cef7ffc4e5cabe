"""Shared by the benchmark scripts: print a result as JSON and as a Markdown table (docs/benchmarks.md), write
the JSON under benchmarks/results/, give scratch folders that are deleted at exit, and run ranks with a bound."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import torch.multiprocessing as mp

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def spawn_ranks(fn: Callable, args: tuple, nprocs: int, timeout_s: float) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` with a bound: `mp.spawn` waits for its ranks
    without one, and an uneven_split run once sat 7 minutes on a rank that never exited.

    Raises:
        TimeoutError: a rank is still running after `timeout_s` seconds (all of them are killed).
        torch.multiprocessing.ProcessRaisedException / ProcessExitedException: a rank failed.
    """
    ranks = mp.start_processes(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)}: ranks still running after {timeout_s:.0f} s")


def default_out(name: str) -> str:
    return os.path.join(RESULTS, f"{name}.json")


def scratch(prefix: str) -> str:
    """A new folder under the system temp dir, deleted when the benchmark exits (checkpoints of a
    benchmark run take gigabytes: the goodput benchmark's plain runs alone ~2 GB each)."""
    root = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def scalars(result: dict, prefix: str = "") -> dict[str, object]:
    """The result's numbers and strings by dotted key (nested dicts flattened; lists left out)."""
    flat: dict[str, object] = {}
    for k, v in result.items():
        if isinstance(v, dict):
            flat.update(scalars(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            flat[f"{prefix}{k}"] = v
    return flat


def report(result: dict, out: str) -> None:
    print(json.dumps(result, indent=2))
    print("\n| measure | value |\n|---|---|")
    for k, v in scalars(result).items():
        print(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
