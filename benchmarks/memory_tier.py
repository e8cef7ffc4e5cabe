"""The memory tier (`checkpoint.memory`) against durable checkpoints alone, side by side in one Ray session.

Part 1, stall and restore (`--preset`, default `125m`, 2 CPU workers, the demo's stdlib corpus): two runs
of `--steps` (20) steps with a durable checkpoint every 6 steps, one with the memory tier off, one with a
memory checkpoint every 2 steps, each killed before step 9 by a `kill` fault (which settles both tiers
first: the runs resume from steps 6 and 8, deterministic). Reported:
  - stall: the `checkpoint_stall_s` of the step after each save (a save's staging is waited for before the
    next optimizer step), medians for memory saves and durable saves of the memory run: memory / durable;
  - restore: the resumed attempt's `restore_s` (`Trainer.begin`, the restore alone) from memory and from
    durable storage on local disk: memory / durable (target <= 0.25).
Part 2, goodput (`--rounds`, the demo config at the `small` preset, `benchmarks/goodput.py`'s runner and
kills): restart mode with the tier off and with `checkpoint.memory.interval: auto`, under the same seeded
SIGKILLs at random moments, and a plain Ray Train restart. Reported per variant: goodput after startup,
lost work and restore seconds per failure, each failure's `restored_from`; the ceiling the plain restart
alone sets (`goodput_ceiling_plain_restart`, as goodput.py); and the memory tier's interval in seconds.
Targets: lost work per failure at most one memory interval; restart goodput with the tier at or above the
ceiling.

Prints JSON and writes benchmarks/results/memory_tier.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import goodput
import ray
from mlflow.tracking import MlflowClient

from raytrain_ft.config import load_config
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.prepare import PrepareSettings
from raytrain_ft.launch.driver import RAY_NODE_ENV, WORKER_ENV, run
from raytrain_ft.launch.prepare import prepare
from raytrain_ft.telemetry.tracking import MlflowRecorder
from report import default_out, report, scratch

DURABLE_EVERY, MEMORY_EVERY, KILL_AT = 6, 2, 9
MEMORY_AUTO = ("checkpoint.memory.interval=auto", "checkpoint.memory.interval_steps=3")


def stall_run(root: str, preset: str, steps: int, memory: bool) -> dict:
    """One part-1 run; its attempts' restore and the stall after each save, by tier."""
    tier = [f"checkpoint.memory.interval_steps={MEMORY_EVERY}", f"checkpoint.memory.dir={root}/shm"] if memory else []
    cfg = load_config(
        os.path.join(goodput.REPO, "configs", "demo.yaml"),
        [
            f"data.path={goodput.DATA}",
            f"run.storage_path={root}/runs",
            "run.name=memory-tier",
            f"tracking.uri=sqlite:///{root}/mlflow.db",
            f"model.preset={preset}",
            f"train.max_steps={steps}",
            f"checkpoint.interval_steps={DURABLE_EVERY}",
            f"faults=[{{kind: kill, step: {KILL_AT}, rank: 1}}]",
            *tier,
        ],
    )
    run_id = run(cfg)
    attempts = [e for e in MlflowRecorder(cfg.tracking.uri, run_id).events() if e["kind"] == "attempt_start"]
    history = MlflowClient(cfg.tracking.uri).get_metric_history(run_id, "train/checkpoint_stall_s")
    stall = {int(m.step): m.value for m in sorted(history, key=lambda m: m.timestamp)}  # a re-run step: its last
    durable = [s for s in range(DURABLE_EVERY, steps, DURABLE_EVERY)]
    memory_saves = [s for s in range(MEMORY_EVERY, steps, MEMORY_EVERY) if s not in durable and s != KILL_AT - 1]
    return {
        "resumed": [(a["resumed_from"], a["restored_from"], a.get("restore_s")) for a in attempts],
        "restore_s": attempts[-1].get("restore_s"),
        "stall_after_durable_s": [stall[s + 1] for s in durable if s + 1 in stall],
        "stall_after_memory_s": [stall[s + 1] for s in memory_saves if s + 1 in stall] if memory else [],
    }


def part1(preset: str, steps: int) -> dict:
    durable = stall_run(scratch("memory-tier-durable-"), preset, steps, memory=False)
    memory = stall_run(scratch("memory-tier-memory-"), preset, steps, memory=True)
    med = statistics.median
    stall_ratio = med(memory["stall_after_memory_s"]) / med(memory["stall_after_durable_s"])
    restore_ratio = memory["restore_s"] / durable["restore_s"]
    return {
        "durable_only": durable,
        "memory_tier": memory,
        "memory_stall_over_durable_stall": stall_ratio,
        "restore_memory_over_durable_local_disk": restore_ratio,
        "targets_met": {"restore from memory <= 0.25 of durable (local disk)": restore_ratio <= 0.25},
    }


def per_failure(run: dict) -> dict:
    """Lost work and restore seconds per failure of one goodput run (its recovery rows)."""
    rows = run["recoveries"]
    return {
        "lost_compute_s": [r.get("lost_compute_s") for r in rows],
        "restore_s": [r.get("restore_s") for r in rows],
        "restored_from": [r.get("restored_from") for r in rows],
    }


def part2(rounds: int, kills: int, mtbf_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    m = load_manifest(goodput.DATA)
    variants = {"restart": (), "restart_memory_tier": MEMORY_AUTO}
    step_s = dict.fromkeys(variants, 1.7)
    out: list[dict] = []
    for _ in range(rounds):
        gaps = goodput.scaled_gaps(rng, kills, mtbf_s)
        ranks = [rng.randrange(2) for _ in gaps]
        rd: dict = {}
        for name, overrides in variants.items():
            extra = (*overrides, f"checkpoint.memory.dir={scratch('memory-tier-shm-')}") if overrides else ()
            root = scratch(f"memory-tier-{name}-")
            r = goodput.raytrain_ft(root, "restart", gaps, ranks, mtbf_s, step_s[name], 5.0, 0, overrides=extra)
            step_s[name] = r["median_step_time_s"] or step_s[name]
            r["goodput_after_startup"] = goodput.after_startup(r)
            r["per_failure"] = per_failure(r)
            if overrides:
                history = MlflowClient(f"sqlite:///{root}/mlflow.db").get_metric_history(
                    r["run_id"], "memory_checkpoint_interval_s"
                )
                r["memory_interval_s"] = [h.value for h in history]
            rd[name] = r
        rd["plain_ray_train"] = goodput.plain(scratch("memory-tier-plain-"), m.vocab_size, m.seq_len, kills, rng)
        out.append(rd)
    plain = [r for rd in out for r in rd["plain_ray_train"]["recoveries"]]
    ceiling = goodput.ceiling(mtbf_s, plain, out)
    after = {name: [rd[name]["goodput_after_startup"] for rd in out] for name in variants}
    lost = [x for rd in out for x in rd["restart_memory_tier"]["per_failure"]["lost_compute_s"] if x is not None]
    interval = [x for rd in out for x in rd["restart_memory_tier"].get("memory_interval_s", [])]
    return {
        "goodput_after_startup": after,
        "goodput_ceiling_plain_restart": ceiling,
        "lost_compute_s_per_failure": {
            name: [x for rd in out for x in rd[name]["per_failure"]["lost_compute_s"]] for name in variants
        },
        "restore_s_per_failure": {
            name: [x for rd in out for x in rd[name]["per_failure"]["restore_s"]] for name in variants
        },
        "restored_from": [x for rd in out for x in rd["restart_memory_tier"]["per_failure"]["restored_from"]],
        "memory_interval_s": interval,
        "targets_met": {
            "lost work per failure <= one memory interval": bool(lost and interval) and max(lost) <= max(interval),
            "restart goodput with the tier >= plain ceiling": ceiling is not None
            and statistics.median(after["restart_memory_tier"]) >= ceiling,
        },
        "rounds": out,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="125m")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="goodput rounds (0: part 1 only)")
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--mtbf-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=default_out("memory_tier"))
    args = p.parse_args()
    started = time.time()
    if not os.path.exists(os.path.join(goodput.DATA, "manifest.json")):
        prepare(None, goodput.DATA, PrepareSettings(seq_len=256, vocab_size=8192))
    os.environ.update(RAY_NODE_ENV)
    ray.init(
        address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV}
    )
    result = {"stall_and_restore": part1(args.preset, args.steps)}
    if args.rounds:
        result["goodput"] = part2(args.rounds, args.kills, args.mtbf_s, args.seed)
    ray.shutdown()
    report({"scale": vars(args), "elapsed_s": time.time() - started, **result}, args.out)


if __name__ == "__main__":
    main()
