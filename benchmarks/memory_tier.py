"""The memory tier (`checkpoint.memory`) against durable checkpoints alone, side by side in one Ray session.

Part 1, stall and restore (`--preset`, default `125m`, 2 CPU workers, the demo's stdlib corpus): three runs
of `--steps` (20) steps with a durable checkpoint every 6 steps: the memory tier off with the run on local
disk, off with the run on an S3 stand-in (moto, 127.0.0.1, as tests/test_remote_storage.py), and on (a
memory checkpoint every 2 steps, the run on local disk), each killed before step 9 by a `kill` fault
(which settles both tiers first: the runs resume from steps 6, 6 and 8, deterministic). Reported:
  - stall: the `checkpoint_stall_s` of the step after each save (a save's staging is waited for before the
    next optimizer step), medians for memory saves and durable saves of the memory run: memory / durable;
  - restore: the resumed attempt's `restore_s` (`Trainer.begin`, the restore alone) from memory and from
    durable storage, on local disk and on the S3 stand-in: memory / durable (target <= 0.25).
Part 2, goodput (`--rounds`, the demo config at the `small` preset, `benchmarks/goodput.py`'s runner and
kills): restart mode with the tier off and with `checkpoint.memory.interval: auto`, under the same seeded
SIGKILLs at random moments, and a plain Ray Train restart. Both variants write their durable checkpoints to
a store as slow as object storage is for a large model (`--durable-write-s`, 20 s added to every durable
write: a `slow_save` fault; memory-tier writes are not slowed): on this machine's local disk a durable save
costs what a memory one does, auto plans one every step and the tier has nothing to add. Reported per
variant: goodput after startup, and steady goodput (after startup, before the final save: `steady`), lost work
and restore seconds per failure, each failure's `restored_from`; the ceiling the plain restart alone sets
(`goodput_ceiling_plain_restart`, as goodput.py); and the memory tier's interval in seconds. Targets: lost
work per failure at most one memory interval; restart mode's steady goodput with the tier at or above the
ceiling. The ceiling is a steady state (per failure, in a run that goes on), so it is compared with the
steady goodput: the final save, a one-off of each run like its startup, is a slow store's full write here
(20 s and more, a wait for the previous one included: 6-12 % of these few-minute runs).

Prints JSON and writes benchmarks/results/memory_tier.json.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import time

import goodput
import ray
from mlflow.tracking import MlflowClient

from raytrain_ft.core.config_files import load_config
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.prepare import PrepareSettings
from raytrain_ft.launch.driver import WORKER_ENV, run
from raytrain_ft.launch.prepare import prepare
from raytrain_ft.launch.ray_start import RAY_NODE_ENV
from raytrain_ft.telemetry.tracking import MlflowRecorder
from report import default_out, report, scratch

DURABLE_EVERY, MEMORY_EVERY, KILL_AT = 6, 2, 9
MEMORY_AUTO = ("checkpoint.memory.interval=auto", "checkpoint.memory.interval_steps=3")


def stall_run(root: str, preset: str, steps: int, memory: bool, storage: str = "") -> dict:
    """One part-1 run (durable checkpoints in `storage`, default `root`/runs); its attempts' restore and
    the stall after each save, by tier."""
    tier = [f"checkpoint.memory.interval_steps={MEMORY_EVERY}", f"checkpoint.memory.dir={root}/shm"] if memory else []
    cfg = load_config(
        os.path.join(goodput.REPO, "configs", "demo.yaml"),
        [
            f"data.path={goodput.DATA}",
            f"run.storage_path={storage or root + '/runs'}",
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


def s3_stand_in() -> str:
    """A local S3-compatible server (moto, as tests/test_remote_storage.py) for the durable store: the
    environment the workers inherit names it; returns the run storage URL."""
    import s3fs
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False).start()
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    s3fs.S3FileSystem().makedirs("rtft-bench", exist_ok=True)
    return "s3://rtft-bench/runs"


def part1(preset: str, steps: int, s3: str) -> dict:
    durable = stall_run(scratch("memory-tier-durable-"), preset, steps, memory=False)
    on_s3 = stall_run(scratch("memory-tier-s3-"), preset, steps, memory=False, storage=s3)
    memory = stall_run(scratch("memory-tier-memory-"), preset, steps, memory=True)
    med = statistics.median
    stall_ratio = med(memory["stall_after_memory_s"]) / med(memory["stall_after_durable_s"])
    local, remote = memory["restore_s"] / durable["restore_s"], memory["restore_s"] / on_s3["restore_s"]
    return {
        "durable_only_local_disk": durable,
        "durable_only_s3_stand_in": on_s3,
        "memory_tier": memory,
        "memory_stall_over_durable_stall": stall_ratio,
        "restore_memory_over_durable_local_disk": local,
        "restore_memory_over_durable_s3_stand_in": remote,
        "targets_met": {
            "restore from memory <= 0.25 of durable (local disk)": local <= 0.25,
            "restore from memory <= 0.25 of durable (S3 stand-in)": remote <= 0.25,
        },
    }


def per_failure(run: dict) -> dict:
    """Lost work and restore seconds per failure of one goodput run (its recovery rows)."""
    rows = run["recoveries"]
    return {
        "lost_compute_s": [r.get("lost_compute_s") for r in rows],
        "restore_s": [r.get("restore_s") for r in rows],
        "restored_from": [r.get("restored_from") for r in rows],
    }


def final_save_s(uri: str, run_id: str, summary: dict) -> float:
    """Seconds of the run's end spent on its final save (`Trainer.finish`: the last checkpoint written
    and committed): the run's whole checkpoint stall less the stalls of its kept steps
    (`train/checkpoint_stall_s`, each step's last value)."""
    history = MlflowClient(uri).get_metric_history(run_id, "train/checkpoint_stall_s")
    per_step = {int(m.step): m.value for m in sorted(history, key=lambda m: m.timestamp)}
    return max(0.0, summary["badput_checkpoint_stall_s"] - sum(per_step.values()))


def steady(run: dict) -> float:
    """Steady goodput: productive seconds / (wall seconds - startup - the final save)."""
    s = run["summary"]
    return s["productive_s"] / (s["wall_s"] - s["badput_startup_s"] - run["final_save_s"])


def part2(rounds: int, kills: int, mtbf_s: float, seed: int, durable_write_s: float) -> dict:
    rng = random.Random(seed)
    m = load_manifest(goodput.DATA)
    # a durable store as slow as object storage is for a large model: every durable write takes
    # `durable_write_s` more (a `slow_save` fault: the writer sleeps; memory-tier writes are not slowed)
    slow = (f"faults=[{{kind: slow_save, step: 1, steps: 100000, seconds: {durable_write_s}, rank: -1}}]",)
    variants = {"restart": slow, "restart_memory_tier": (*slow, *MEMORY_AUTO)}
    step_s = dict.fromkeys(variants, 1.7)
    out: list[dict] = []
    for _ in range(rounds):
        gaps = goodput.scaled_gaps(rng, kills, mtbf_s)
        ranks = [rng.randrange(2) for _ in gaps]
        rd: dict = {}
        for name, overrides in variants.items():
            extra = (*overrides, f"checkpoint.memory.dir={scratch('memory-tier-shm-')}")
            root = scratch(f"memory-tier-{name}-")
            r = goodput.raytrain_ft(root, "restart", gaps, ranks, mtbf_s, step_s[name], 5.0, 0, overrides=extra)
            step_s[name] = r["median_step_time_s"] or step_s[name]
            r["goodput_after_startup"] = goodput.after_startup(r)
            r["final_save_s"] = final_save_s(f"sqlite:///{root}/mlflow.db", r["run_id"], r["summary"])
            r["goodput_steady"] = steady(r)
            r["per_failure"] = per_failure(r)
            if name != "restart":
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
    steady_goodput = {name: [rd[name]["goodput_steady"] for rd in out] for name in variants}
    lost = [x for rd in out for x in rd["restart_memory_tier"]["per_failure"]["lost_compute_s"] if x is not None]
    interval = [x for rd in out for x in rd["restart_memory_tier"].get("memory_interval_s", [])]
    return {
        "goodput_after_startup": after,
        "goodput_steady": steady_goodput,
        "final_save_s": {name: [rd[name]["final_save_s"] for rd in out] for name in variants},
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
            "restart steady goodput with the tier >= plain ceiling": ceiling is not None
            and statistics.median(steady_goodput["restart_memory_tier"]) >= ceiling,
        },
        "rounds": out,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="125m")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1, help="goodput rounds (0: part 1 only)")
    p.add_argument("--skip-part1", action="store_true", help="goodput only (part 1's figures stay as they were)")
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--mtbf-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--durable-write-s", type=float, default=20.0, help="part 2: seconds added to each durable write")
    p.add_argument("--out", default=default_out("memory_tier"))
    args = p.parse_args()
    started = time.time()
    if not os.path.exists(os.path.join(goodput.DATA, "manifest.json")):
        prepare(None, goodput.DATA, PrepareSettings(seq_len=256, vocab_size=8192))
    os.environ.update(RAY_NODE_ENV)
    s3 = s3_stand_in()  # before Ray starts: its workers inherit the endpoint
    ray.init(
        address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV}
    )
    result = {} if args.skip_part1 else {"stall_and_restore": part1(args.preset, args.steps, s3)}
    if args.rounds:
        result["goodput"] = part2(args.rounds, args.kills, args.mtbf_s, args.seed, args.durable_write_s)
    ray.shutdown()
    report({"scale": vars(args), "elapsed_s": time.time() - started, **result}, args.out)


if __name__ == "__main__":
    main()
