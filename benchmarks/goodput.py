"""Goodput under a failure about every 60 s, against the Young/Daly bound and a plain Ray Train restart.

1. raytrain-ft: the demo config (`small` preset, 2 CPU workers, stdlib corpus) with
   `checkpoint.interval: auto`, `failure.mtbf_hours_per_gpu` set so the planned cluster MTBF is the
   injected failure period, and a `raise` fault on rank 1 about every `--failure-every-s` seconds
   of training (the step count comes from a one-rank timing of the same step, x `--ddp-factor`).
   From MLflow: the goodput summary, the mean checkpoint cost, and the time from each failure
   (the fault marker's timestamp) to the first resumed step (`first_step` event).
2. Young/Daly bound for the measured cost C, failure period M (steady-state wall time / failures)
   and restart time R: `1 - expected_waste_fraction(daly(C, M), C, M, R)` (first-order model;
   startup excluded, as in the model).
3. A plain Ray Train restart of the same worker group (2 workers, same resources and runtime env):
   `ray.train.torch.prepare_model` on the same model, `torch.save` + `Checkpoint.from_directory`
   every 5 steps (Ray's documented pattern), an exception at fixed steps; failure -> first resumed step.

Prints JSON and writes benchmarks/results/goodput.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tempfile
import time

import ray
import ray.train
import ray.train.torch
import torch
from mlflow.tracking import MlflowClient
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from raytrain_ft.config import load_config
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.prepare import PrepareSettings, prepare
from raytrain_ft.interval import daly_interval_s, expected_waste_fraction
from raytrain_ft.launch.trainer import WORKER_ENV, run
from raytrain_ft.model import build_model, lm_loss
from raytrain_ft.tracking import GOODPUT_SUMMARY, RunLogger
from report import default_out, report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "data", "stdlib")


def one_rank_step_s(vocab: int, seq_len: int, micro: int, accum: int) -> float:
    """Median seconds of one optimizer step of the `small` preset on one process."""
    torch.manual_seed(0)
    model = build_model("small", vocab, seq_len, 0.0)
    opt = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, vocab, (micro, seq_len + 1))
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        for _ in range(accum):
            lm_loss(model, tokens).backward()
        opt.step(), opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def recovery_s(events: list[dict], failed_at: list[float]) -> list[float]:
    """For each failure time: seconds to the next `first_step` event."""
    firsts = sorted(e["time"] for e in events if e["kind"] == "first_step")
    return [next(t for t in firsts if t > f) - f for f in failed_at]


def ours(root: str, every_steps: int, failures: int, every_s: float) -> dict:
    faults = ", ".join(f"{{kind: raise, step: {every_steps * (k + 1)}, rank: 1}}" for k in range(failures))
    cfg = load_config(
        os.path.join(REPO, "configs", "demo.yaml"),
        [
            f"data.path={DATA}",
            f"run.storage_path={root}/runs",
            "run.name=goodput",
            f"tracking.uri=sqlite:///{root}/mlflow.db",
            f"train.max_steps={every_steps * (failures + 1)}",
            "checkpoint.interval=auto",
            f"failure.mtbf_hours_per_gpu={2 * every_s / 3600}",  # 2 workers: cluster MTBF = every_s
            f"failure.max_failures={failures + 1}",
            f"faults=[{faults}]",
        ],
    )
    run_id = run(cfg)
    client = MlflowClient(cfg.tracking.uri)
    with open(client.download_artifacts(run_id, GOODPUT_SUMMARY)) as f:
        summary = json.load(f)
    failed_at = []
    for marker in glob.glob(os.path.join(cfg.run.storage_path, cfg.run.name, "faults", "*.fired")):
        with open(marker) as f:
            failed_at.append(float(f.read()))
    failed_at.sort()
    costs = [m.value for m in client.get_metric_history(run_id, "checkpoint_cost_s")]
    intervals = [int(m.value) for m in client.get_metric_history(run_id, "checkpoint_interval_steps")]
    return {
        "summary": summary,
        "failures": len(failed_at),
        "failure_to_first_step_s": recovery_s(RunLogger(cfg.tracking.uri, run_id).events(), failed_at),
        "seconds_between_failures": [b - a for a, b in zip(failed_at, failed_at[1:], strict=False)],
        "checkpoint_cost_s": statistics.mean(costs),
        "auto_interval_steps": intervals,
        "max_steps": cfg.train.max_steps,
    }


def plain_train_func(config: dict) -> None:
    """Ray Train's documented pattern: torch.save + Checkpoint.from_directory, resume from get_checkpoint()."""
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(build_model("small", config["vocab"], config["seq_len"], 0.0))
    opt = torch.optim.AdamW(model.parameters())
    start, resumed = 0, ray.train.get_checkpoint()
    if resumed:
        with resumed.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    tokens = torch.randint(0, config["vocab"], (config["micro"], config["seq_len"] + 1))
    for step in range(start + 1, config["max_steps"] + 1):
        for _ in range(config["accum"]):
            lm_loss(model, tokens).backward()
        opt.step(), opt.zero_grad()
        if resumed and step == start + 1 and rank == 0:
            with open(os.path.join(config["root"], f"first-{step}"), "w") as f:
                f.write(str(time.time()))
        marker = os.path.join(config["root"], f"failed-{step}")
        if step in config["fail_at"] and rank == 1 and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(str(time.time()))
            raise RuntimeError(f"injected failure at step {step}")
        if step % 5 == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save(
                        {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step}, f"{d}/state.pt"
                    )
                ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)


def plain(root: str, vocab: int, seq_len: int) -> dict:
    fail_at = [8, 18]
    config = {
        "vocab": vocab,
        "seq_len": seq_len,
        "micro": 2,
        "accum": 2,
        "max_steps": 22,
        "fail_at": fail_at,
        "root": root,
    }
    TorchTrainer(
        plain_train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(name="plain", storage_path=f"{root}/runs", failure_config=FailureConfig(max_failures=2)),
    ).fit()

    def stamp(name: str) -> float:
        with open(os.path.join(root, name)) as f:
            return float(f.read())

    resumed = sorted(stamp(os.path.basename(p)) for p in glob.glob(f"{root}/first-*"))
    failed = sorted(stamp(f"failed-{s}") for s in fail_at)
    return {"failure_to_first_step_s": [next(r for r in resumed if r > f) - f for f in failed]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--failures", type=int, default=3)
    p.add_argument("--failure-every-s", type=float, default=60.0)
    # 2 ranks share 2 cores, all-reduce 27M gradients and checkpoint often: measured ~6.5x one rank's step here
    p.add_argument("--ddp-factor", type=float, default=6.5, help="a 2-rank step's time over one rank's")
    p.add_argument("--out", default=default_out("goodput"))
    args = p.parse_args()
    if not os.path.exists(os.path.join(DATA, "manifest.json")):
        prepare(None, DATA, PrepareSettings(seq_len=256, vocab_size=8192))
    m = load_manifest(DATA)
    step_s = one_rank_step_s(m.vocab_size, m.seq_len, micro=2, accum=2) * args.ddp_factor
    every_steps = max(5, round(args.failure_every_s / step_s))
    ray.init(
        address="local", num_cpus=3, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV}
    )
    ours_result = ours(tempfile.mkdtemp(prefix="goodput-ours-"), every_steps, args.failures, args.failure_every_s)
    plain_result = plain(tempfile.mkdtemp(prefix="goodput-plain-"), m.vocab_size, m.seq_len)
    ray.shutdown()

    s = ours_result["summary"]
    steady_wall = s["wall_s"] - s["badput_startup_s"]
    mtbf = steady_wall / max(1, ours_result["failures"])
    cost, restart = ours_result["checkpoint_cost_s"], statistics.mean(ours_result["failure_to_first_step_s"])
    bound = 1 - expected_waste_fraction(daly_interval_s(cost, mtbf), cost, mtbf, restart)
    ours_restart = statistics.median(ours_result["failure_to_first_step_s"])
    plain_restart = statistics.median(plain_result["failure_to_first_step_s"])
    report(
        {
            "steps_between_failures": every_steps,
            "raytrain_ft": ours_result,
            "plain_ray_train": plain_result,
            "goodput": s["goodput"],
            "goodput_after_startup": s["productive_s"] / steady_wall,
            "young_daly_bound_goodput": bound,
            "bound_inputs": {"checkpoint_cost_s": cost, "mtbf_s": mtbf, "restart_s": restart},
            "failure_to_first_step_s": {"raytrain_ft": ours_restart, "plain_ray_train": plain_restart},
            "restart_over_plain": ours_restart / plain_restart,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
