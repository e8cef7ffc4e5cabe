"""Stragglers on the whole loop: the healthy noise of the ranks' figures, false flags, detection
delay, and steps/s under each `straggler.action` against a healthy run.

`--world-size` W gloo ranks (default 3) on the Ray-free session (`tests/local_run.py`), the `tiny`
preset at seq_len 128 on the stdlib corpus (prepared into a scratch folder, or `--data`),
`micro_batch_size` = the global batch (one pass per step on every rank whatever the split, so a
rank's step costs what its share of sequences costs: at seq_len 128 the per-sequence part
dominates, as on a large model; at seq_len 32 a pass costs the same for 1 to 8 sequences and
rebalancing could buy nothing), the runs one after the other (`runs_of`: one row each): `healthy`
(G = `--global-batch-size`, `--healthy-steps`), `uneven` (G - W + 1: an uneven split), and, with
rank 1 at factor 2 from step 11 (a `slow` fault), `warn` and `rebalance` (`--steps` each);
`exclude`: what training runs at after the exclusion, the same G on W - 1 healthy ranks (the
exclusion's restart through the Ray driver, which this Ray-free script does not run, is
tests/test_straggler_exclusion.py's, and a restart's cost is the goodput benchmark's). With real
compute only, each rank needs a core of its own for the throughput rows to mean anything: the `slow`
fault sleeps, and on fewer cores than ranks the sleeping rank frees a core for the others.
`--device-seconds S` adds a simulated accelerator to every run: each rank waits S per sequence of its
share inside its forward/backward, holding no CPU (a `device` fault, `raytrain_ft.resilience.faults`;
`--jitter J`: each step's wait x (1 + u), u uniform in [-J, J]), and the `slow` fault scales that wait:
with S well above the real compute, the rows hold at W ranks on fewer cores, as on W GPUs driven by
W host processes. The all-reduce, optimizer step and data feed stay real. `--runs healthy,uneven`
with many `--healthy-steps` measures false flags alone (`false_flags_per_rank_step`: flags over the
rank-steps judged in the two runs; `healthy_slow_tail`: how often a rank's window held 1, 2, ... slow
steps, the rate the flag's rule cuts at, and the longest burst).
From each run's MLflow metrics (`train/compute_s_per_seq_rank<r>`) and events: each rank's
slowness (`straggler.slowness`, at the run's shares; percentiles over the healthy runs' steps), the
`straggler` events (a flag in a healthy run is a false flag), the delay from the fault's first step
to the flag, and steps/s (1 / median `train/step_time_s` after step 31; rank 0's step waits for the
slowest rank) against the healthy run, with the factor-2 bounds of an unmitigated straggler (1/F of
healthy), of a perfect rebalance ((W - 1 + 1/F) / W of healthy steps/s, i.e. a step W / (W - 1 +
1/F) x as long) and of an exclusion ((W - 1) / W). `timer_cost`: the straggler measurement's own
cost (`ComputeTimer`: a hook per parameter), the tiny model's forward/backward in this process
with and without it.

Prints JSON and writes benchmarks/results/stragglers.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import sysconfig
import time

import torch
from mlflow.tracking import MlflowClient

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from local_run import local_run  # noqa: E402  (the Ray-free session the tests use)
from raytrain_ft.core.config import StragglerSection  # noqa: E402
from raytrain_ft.core.config_files import load_config
from raytrain_ft.data.position import BatchPlan  # noqa: E402
from raytrain_ft.data.prepare import PrepareSettings  # noqa: E402
from raytrain_ft.launch.prepare import prepare  # noqa: E402
from raytrain_ft.model.causal_lm import build_model, lm_loss  # noqa: E402
from raytrain_ft.resilience.straggler import ComputeTimer, slowness  # noqa: E402
from raytrain_ft.telemetry.tracking import MlflowRecorder  # noqa: E402
from report import default_out, report, scratch  # noqa: E402

F, SLOW_FROM, STEADY_FROM, SEQ_LEN = 2.0, 11, 31, 128
SLOW = f"{{kind: slow, rank: 1, factor: {F}, step: {SLOW_FROM}, steps: 1000000}}"


def runs_of(w: int, g: int) -> dict[str, tuple[int, int, bool, tuple[str, ...]]]:
    """name: (global_batch_size, world_size, slow rank, overrides) of each run at `w` ranks and
    global batch `g` (a multiple of w); `uneven`'s batch g - w + 1 is not."""
    return {
        "healthy": (g, w, False, ()),
        "uneven": (g - w + 1, w, False, ()),
        "warn": (g, w, True, ()),
        "rebalance": (g, w, True, ("straggler.action=rebalance",)),
        "exclude": (g, w - 1, False, ()),
    }


def faults(slow: bool, device_s: float, jitter: float) -> str:
    """The `faults` override: rank 1 at factor F from SLOW_FROM (`slow`), and with `device_s` > 0 the
    simulated accelerator on every rank (a `device` wait of `device_s` per sequence, +-`jitter`)."""
    device = f"{{kind: device, rank: -1, step: 1, steps: 1000000, seconds: {device_s}, jitter: {jitter}}}"
    return f"faults=[{', '.join([SLOW] * slow + [device] * (device_s > 0))}]"


def metric(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def measure(root: str, data: str, name: str, steps: int, g: int, world: int, *overrides: str) -> dict:
    uri = f"sqlite:///{root}/{name}.db"
    cfg = load_config(
        None,
        [
            f"run.name={name}",
            f"run.storage_path={root}/runs",
            f"tracking.uri={uri}",
            f"data.path={data}",
            "model.preset=tiny",
            "model.dropout=0.0",
            f"train.micro_batch_size={g}",
            f"train.max_steps={steps}",
            f"checkpoint.interval_steps={steps}",
            f"scaling.num_workers={world}",
            f"train.global_batch_size={g}",
            *overrides,
        ],
    )
    run_id = local_run(cfg)
    client = MlflowClient(uri)
    figures = [metric(client, run_id, f"train/compute_s_per_seq_rank{r}") for r in range(world)]
    shares = BatchPlan(g, g, world).shares  # the healthy runs' (the slow runs' ratios are not pooled)
    ratios = [slowness([f[s] for f in figures], shares) for s in sorted(figures[0])]
    step_time = metric(client, run_id, "train/step_time_s")
    flags = [e for e in MlflowRecorder(uri, run_id).events() if e["kind"] == "straggler"]
    return {
        "ratios": ratios,
        "steps_per_s": 1 / statistics.median(step_time[s] for s in step_time if s >= STEADY_FROM),
        "flags": [{k: e[k] for k in ("step", "rank", "factor", "first_step")} for e in flags],
    }


def slow_tail(runs: list[list[list[float]]]) -> dict:
    """How close healthy noise comes to a flag, under the default rule (`StragglerSection`: slow
    above `threshold`, flagged at `min_slow_steps` of `window`): over every rank and every `window`
    consecutive steps of `runs` (each run: one row of ratios per step), the fraction with at least j
    slow steps, j = 1 .. min_slow_steps (the last is the false-flag rate per rank-window), and the
    longest run of consecutive slow steps of one rank."""
    rule = StragglerSection()
    counts, longest = [], 0
    for ratios in runs:
        for r in range(len(ratios[0])):
            slow = [row[r] > rule.threshold for row in ratios]
            counts += [sum(slow[i : i + rule.window]) for i in range(len(slow) - rule.window + 1)]
            burst = 0
            for x in slow:
                burst = burst + 1 if x else 0
                longest = max(longest, burst)
    return {
        "rank_windows": len(counts),
        "at_least_j_slow": {j: sum(c >= j for c in counts) / len(counts) for j in range(1, rule.min_slow_steps + 1)},
        "longest_slow_burst": longest,
    }


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def timer_cost(passes: int = 300) -> float:
    """Seconds per forward/backward pass with `ComputeTimer` over without it (tiny model, one
    thread, 2 sequences of SEQ_LEN tokens; alternating, medians)."""
    torch.set_num_threads(1)
    timed, bare = build_model("tiny", 512, SEQ_LEN), build_model("tiny", 512, SEQ_LEN)
    timer = ComputeTimer(timed, torch.device("cpu"))
    tokens = torch.randint(0, 512, (2, SEQ_LEN + 1))
    out: dict[str, list[float]] = {"timed": [], "bare": []}
    runs = [("timed", timed, timer), ("bare", bare, contextlib.nullcontext())]
    for i in range(passes):
        for name, model, around in runs if i % 2 else runs[::-1]:
            t0 = time.perf_counter()
            with around:
                lm_loss(model, tokens).backward()
            out[name].append(time.perf_counter() - t0)
    return statistics.median(out["timed"]) / statistics.median(out["bare"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps of the slow and exclude runs")
    parser.add_argument("--healthy-steps", type=int, default=500, help="steps of the healthy and uneven runs")
    parser.add_argument(
        "--device-seconds",
        type=float,
        default=0.0,
        help="a simulated accelerator: every rank waits this long per sequence, holding no CPU (0: real compute only)",
    )
    parser.add_argument(
        "--jitter", type=float, default=0.0, help="the device wait's random spread per step (0.2: +-20%%)"
    )
    parser.add_argument("--runs", default="healthy,uneven,warn,rebalance,exclude", help="which runs (comma list)")
    parser.add_argument("--world-size", type=int, default=3, help="ranks (W); each takes a core: W <= the cores")
    parser.add_argument("--global-batch-size", type=int, default=12, help="G, a multiple of W")
    parser.add_argument("--out", default=default_out("stragglers"))
    parser.add_argument("--data", default="", help="a dataset prepared as the tests' (default: prepare one; Ray Data)")
    args = parser.parse_args()
    root = scratch("stragglers-")
    data = args.data or os.path.join(root, "data")
    if not args.data:
        settings = PrepareSettings(seq_len=SEQ_LEN, vocab_size=512, rows_per_row_group=2, validation_fraction=0.0)
        prepare(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py"), data, settings)
    w, plan = args.world_size, runs_of(args.world_size, args.global_batch_size)
    simulated = faults(False, args.device_seconds, args.jitter), faults(True, args.device_seconds, args.jitter)
    runs = {
        name: measure(
            root,
            data,
            name,
            args.healthy_steps if name in ("healthy", "uneven") else args.steps,
            g,
            world,
            simulated[slow],
            *overrides,
        )
        for name, (g, world, slow, overrides) in plan.items()
        if name in args.runs.split(",")
    }
    healthy_ratios = [x for name in ("healthy", "uneven") for row in runs[name]["ratios"] for x in row]
    shares = BatchPlan(plan["uneven"][0], plan["uneven"][0], w).shares
    small = shares.index(min(shares))  # the rank with the smallest share of the uneven split
    uneven_small = [row[small] for row in runs["uneven"]["ratios"]]
    healthy_sps = runs["healthy"]["steps_per_s"]
    false_flags = len(runs["healthy"]["flags"]) + len(runs["uneven"]["flags"])
    result: dict = {
        "world_size": w,
        "global_batch_size": args.global_batch_size,
        "uneven_shares": list(shares),
        "device_seconds_per_sequence": args.device_seconds,  # 0: real compute only
        "device_jitter": args.jitter,
        "factor": F,
        "steps": args.steps,
        "healthy_steps": args.healthy_steps,
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "healthy_ratio_p50": percentile(healthy_ratios, 50),
        "healthy_ratio_p99": percentile(healthy_ratios, 99),
        "healthy_ratio_max": max(healthy_ratios),
        "uneven_small_share_ratio_p50": percentile(uneven_small, 50),
        "false_flags_healthy": len(runs["healthy"]["flags"]),
        "false_flags_uneven": len(runs["uneven"]["flags"]),
        # judged rank-steps of the two healthy runs (every rank is judged at every step)
        "false_flags_per_rank_step": false_flags / (2 * args.healthy_steps * w),
        "healthy_slow_tail": slow_tail([runs[name]["ratios"] for name in ("healthy", "uneven")]),
        "steps_per_s_healthy": healthy_sps,
        "bound_unmitigated": 1 / F,
        "bound_rebalanced": (w - 1 + 1 / F) / w,
        "bound_excluded": (w - 1) / w,
        "timer_cost": timer_cost(),
    }
    if "warn" in runs:
        result["slow_rank_ratio_p50"] = percentile(
            [row[1] for s, row in enumerate(runs["warn"]["ratios"], 1) if s >= SLOW_FROM + 1], 50
        )
    for name in ("warn", "rebalance"):
        if name in runs:
            flags = runs[name]["flags"]
            result[name] = {
                "flags": flags,
                "right_rank_flagged": [f["rank"] for f in flags][:1] == [1],
                "detection_delay_steps": flags[0]["step"] - SLOW_FROM if flags else None,
                "steps_per_s": runs[name]["steps_per_s"],
                "vs_healthy": runs[name]["steps_per_s"] / healthy_sps,
                "vs_rebalance_bound": runs[name]["steps_per_s"] / healthy_sps / result["bound_rebalanced"],
            }
    if "exclude" in runs:
        result["exclude"] = {
            "steps_per_s": runs["exclude"]["steps_per_s"],
            "vs_healthy": runs["exclude"]["steps_per_s"] / healthy_sps,
            "vs_exclude_bound": runs["exclude"]["steps_per_s"] / healthy_sps / result["bound_excluded"],
            "false_flags": len(runs["exclude"]["flags"]),
        }
    report(result, args.out)


if __name__ == "__main__":
    main()
