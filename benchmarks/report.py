"""Shared by the benchmark scripts: print a result as JSON and write it under benchmarks/results/."""

from __future__ import annotations

import json
import os

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def default_out(name: str) -> str:
    return os.path.join(RESULTS, f"{name}.json")


def report(result: dict, out: str) -> None:
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
