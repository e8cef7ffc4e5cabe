"""Failures that cluster around worker-group starts, and restart mode's kill -> first step against a
plain Ray Train restart, side by side in one Ray session (3 logical CPUs).

1. Clustered (`configs/tiny.yaml`, 2 workers at exact fit: each takes half of the cluster's CPUs, so a
   placement group left behind by a start would leave the next start nothing): rank 1 killed at
   step 7, then three failures in a row at the starts that follow, each at another moment
   (`kill_in_setup`, `kill_at_launch`, `kill_at_first_step`, `raytrain_ft.resilience.faults`). Measured: seconds
   from the third clustered failure (the `kill_at_first_step` fault's marker, written just before the
   SIGKILL) to the next trained step (the first `train/loss` value logged after it: the step's commit
   to MLflow), and the same from each earlier failure, plus whether every group start found the
   job's free resources (`group_start` events).
2. The two recovery targets, side by side: `--kills` (2) SIGKILLs at the same seeded random moments
   and ranks in a raytrain-ft `restart` run and a `replica` run, and as many in a plain Ray Train
   restart, with goodput.py's own runs (`goodput.raytrain_ft`, `goodput.plain`: the demo config,
   2 CPU workers at 0.5 CPU, at the model `--preset`, its `small` by default; `--step-s`, the
   preset's expected step time, sizes the runs so that every kill lands), one after the other: the
   median of kill -> first resumed step of `restart` and of the plain restart, and their ratio
   (target <= 1.2); the median of kill -> the survivors' first committed step of `replica`
   (target <= 3 s); each run's recovery phases (`goodput.phase_medians`), where the seconds go.

About 10 minutes on the 2-core reference machine when it is otherwise idle. Prints JSON and writes
benchmarks/results/clustered_failures.json.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import time
from pathlib import Path

import ray
from goodput import DATA, phase, phase_medians, plain, raytrain_ft, scaled_gaps
from mlflow.tracking import MlflowClient

from raytrain_ft.core.config_files import load_config
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.prepare import PrepareSettings
from raytrain_ft.launch.driver import WORKER_ENV, RunFailed, run
from raytrain_ft.launch.prepare import prepare
from raytrain_ft.launch.ray_start import RAY_NODE_ENV
from raytrain_ft.resilience.recovery import failures
from raytrain_ft.telemetry.tracking import MlflowRecorder
from report import default_out, report, scratch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIB_JSON = os.path.join(os.path.dirname(os.__file__), "json", "*.py")
CLUSTERED = (
    "faults=[{kind: kill, step: 7, rank: 1}, {kind: kill_in_setup, step: 5, rank: 1},"
    " {kind: kill_at_launch, step: 5, rank: 0}, {kind: kill_at_first_step, step: 5, rank: 1}]"
)


def clustered(root: str) -> dict:
    data = os.path.join(root, "data")
    prepare(
        STDLIB_JSON,
        data,
        PrepareSettings(
            seq_len=32, vocab_size=512, rows_per_row_group=2, validation_fraction=0.0, validation_min_docs=0
        ),
    )
    cpus = ray.available_resources()["CPU"]
    cfg = load_config(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [
            f"data.path={data}",
            f"run.storage_path={root}/runs",
            f"tracking.uri=sqlite:///{root}/mlflow.db",
            "train.max_steps=30",
            "failure.max_failures=4",
            f"scaling.cpus_per_worker={cpus / 2}",
            CLUSTERED,
        ],
    )
    started = time.time()
    failed = None
    try:
        run(cfg)
    except RunFailed as e:  # reported with the run's failures instead of ending the benchmark
        failed = str(e)
    wall_s = time.time() - started
    run_root = os.path.join(root, "runs", cfg.run.name)
    run_id = Path(run_root, "mlflow_run_id").read_text().strip()
    markers = {}
    for path in glob.glob(os.path.join(run_root, "faults", "*.fired")):
        with open(path) as f:
            markers[int(os.path.basename(path).split("-")[0])] = float(f.read())
    events = MlflowRecorder(cfg.tracking.uri, run_id).events()
    if failed:
        return {
            "failed": failed,
            "wall_s": wall_s,
            "fault_fired_s": {NAMES_ALL[i]: t - started for i, t in sorted(markers.items())},
            "failures": [
                {"at_s": f["time"] - started, **{k: f.get(k) for k in ("source", "causes", "details")}}
                for _, f in failures(events)
            ],
            "resumed_from": [e.get("resumed_from") for e in events if e["kind"] == "attempt_start"],
        }
    steps = sorted(m.timestamp / 1000 for m in MlflowClient(cfg.tracking.uri).get_metric_history(run_id, "train/loss"))

    def to_next_step(t: float) -> float:
        return next(s for s in steps if s > t) - t

    starts = [e for e in events if e["kind"] == "group_start"]
    return {
        "wall_s": wall_s,
        "failure_to_next_step_s": {name: to_next_step(markers[i]) for i, name in enumerate(NAMES_ALL)},
        "group_starts": len(starts),
        "every_start_found_the_baseline": all(s["free"] == s["baseline"] and not s["placement_groups"] for s in starts),
    }


NAMES_ALL = ("kill_at_step_7", "kill_in_setup", "kill_at_launch", "kill_at_first_step")
MODES = ("restart", "replica")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=2, help="SIGKILLs in the restart run and in the plain run")
    p.add_argument("--mtbf-s", type=float, default=20.0, help="mean seconds of training between kills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="small", help="model preset of part 2's three runs (the demo's: small)")
    p.add_argument("--step-s", type=float, default=1.7, help="the preset's expected step time (sizes part 2's runs)")
    p.add_argument("--out", default=default_out("clustered_failures"))
    args = p.parse_args()
    started = time.time()
    if not os.path.exists(os.path.join(DATA, "manifest.json")):
        prepare(None, DATA, PrepareSettings(seq_len=256, vocab_size=8192))
    m = load_manifest(DATA)
    rng = random.Random(args.seed)
    os.environ.update(RAY_NODE_ENV)
    ray.init(
        address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV}
    )
    result: dict = {"clustered": clustered(scratch("clustered-"))}
    gaps = scaled_gaps(rng, args.kills, args.mtbf_s)
    ranks = [rng.randrange(2) for _ in gaps]
    runs = {
        mode: raytrain_ft(
            scratch(f"clustered-{mode}-"), mode, gaps, ranks, args.mtbf_s, args.step_s, 5.0, 0, args.preset
        )
        for mode in MODES
    }
    runs["plain_ray_train"] = plain(
        scratch("clustered-plain-"), m.vocab_size, m.seq_len, args.kills, rng, args.preset, args.step_s
    )
    ray.shutdown()
    ours, theirs = (phase(runs[k]["recoveries"], "first_step_done") for k in ("restart", "plain_ray_train"))
    ratio = ours["median"] / theirs["median"] if ours["n"] and theirs["n"] else None
    survivors = phase(runs["replica"]["recoveries"], "survivors_committed")
    result.update(
        {
            "scale": {"kills": args.kills, "mtbf_s": args.mtbf_s, "seed": args.seed, "preset": args.preset},
            "kill_to_first_step_s": {"restart": ours, "plain_ray_train": theirs},
            "restart_over_plain": ratio,
            "replica_kill_to_survivors_commit_s": survivors,
            "phases_median_s": {k: phase_medians(r["recoveries"]) for k, r in runs.items()},
            "median_step_time_s": {mode: runs[mode]["median_step_time_s"] for mode in MODES},
            "targets_met": {
                "restart_over_plain <= 1.2": ratio is not None and ratio <= 1.2,
                "replica kill_to_survivors_commit median <= 3 s": survivors["n"] > 0 and survivors["median"] <= 3.0,
            },
            "load_average_1min": os.getloadavg()[0],
            "elapsed_s": time.time() - started,
        }
    )
    report(result, args.out)


if __name__ == "__main__":
    main()
