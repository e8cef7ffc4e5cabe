"""Notice to committed: how long after a drain notice for preemption a run has the step after the
notice committed, in both recovery modes, for `configs/tiny.yaml` and the `125m` preset on CPU,
against the windows clouds give before they take a spot VM (GKE spot 30 s, AWS spot 120 s).

Per mode and preset, in a subprocess of its own (a `ray.cluster_utils.Cluster` needs a process
without another Ray instance): a head and a worker node of 1 CPU each, 2 workers of 1 CPU (one per
node; the layout of tests/scenarios/replica_preemption.py: a 0-CPU head leaves no room for the
lighthouse actor Ray Train places on the controller's node). Once the run has committed its first
checkpoint and trained `--steps-after` more steps, the worker node is drained (`ray drain-node
--reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds 30`); the figure is the `preemption` event's `notice_to_committed_s`
(the drained worker saw the notice -> the next step committed: under `restart` every rank's
checkpoint of it written and registered by Ray Train; under `replica` the step committed by every
replica, the doomed one leaving the quorum after it and the survivor holding it in memory, no
checkpoint), `drain_to_committed_s` from the start of the `ray drain-node` command (adds the
command's own start, `drain_cli_s`, and the drain poll, at most `launch.preemption.POLL_INTERVAL_S`).
The run is then stopped. Also reported: the median step time before the drain and the checkpoint's
size, the two parts of the figure that grow with the model. The corpus: the stdlib's `json` package at seq_len 256 (a
vocabulary of 2048; the step's cost is the model's, not the corpus's). tiny: its config (global
batch 8). 125m: global batch 2 (one sequence per worker: a CPU step of ~100M parameters is
slow). Prints JSON and writes benchmarks/results/preemption.json (about 8 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

WINDOWS_S = {"gke_spot": 30.0, "aws_spot": 120.0}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "data", "stdlib-json")  # the stdlib's json package: a small corpus, quick to prepare
CORPUS = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
MODES = ("restart", "replica")
PRESETS = {
    "tiny": ["model.preset=tiny", "train.global_batch_size=8", "train.micro_batch_size=2"],
    "125m": ["model.preset=125m", "train.global_batch_size=2", "train.micro_batch_size=1"],
}


def one(mode: str, preset: str, workdir: str, steps_after: int) -> None:
    """One mode's and preset's drain (run in this process, which owns its Cluster): prints `RESULT <json>`."""
    # read when ray is imported: the stopped run's driver thread must not start a Ray of its own once
    # its cluster is shut down (`ray.kill` would, and the Cluster then refuses to shut down)
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    from raytrain_ft.data.prepare import PrepareSettings
    from raytrain_ft.launch.driver import WORKER_ENV
    from raytrain_ft.launch.prepare import prepare
    from raytrain_ft.launch.ray_start import RAY_NODE_ENV

    os.environ.update({**RAY_NODE_ENV, **WORKER_ENV})
    # tests/scenarios/replica_preemption.py's layout: the head (driver, Train controller, torchft
    # lighthouse) holds one worker, the drained node the other
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, runtime_env={"env_vars": WORKER_ENV}, log_to_driver=False)
    try:
        if not os.path.exists(os.path.join(DATA, "manifest.json")):  # on this cluster: prepare starts no Ray of its own
            settings = PrepareSettings(
                seq_len=256, vocab_size=2048, rows_per_row_group=4, validation_fraction=0.0, validation_min_docs=0
            )
            prepare(CORPUS, DATA, settings)
        # printed before the shutdown: the stopped run's driver thread may end this process during it
        print("RESULT " + json.dumps(drain_once(mode, preset, workdir, steps_after, cluster, node)), flush=True)
    finally:  # the run is stopped with its cluster
        ray.shutdown()
        cluster.shutdown()


def drain_once(mode: str, preset: str, workdir: str, steps_after: int, cluster, node) -> dict:
    from goodput import in_thread, wait_for
    from mlflow.tracking import MlflowClient

    from raytrain_ft.core.config_files import load_config
    from raytrain_ft.core.run_folder import complete_steps, read_commit_ack, read_latest, step_of
    from raytrain_ft.launch.driver import run
    from raytrain_ft.telemetry.tracking import MlflowRecorder

    cfg = load_config(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [
            f"data.path={DATA}",
            f"run.storage_path={workdir}/runs",
            f"tracking.uri=sqlite:///{workdir}/mlflow.db",
            f"run.name=preempt-{preset}",
            *PRESETS[preset],
            "train.max_steps=1000",
            "checkpoint.interval_steps=3",
            "scaling.cpus_per_worker=1",
            f"failure.recovery={mode}",
        ],
    )
    root = os.path.join(workdir, "runs", f"preempt-{preset}")
    running, _ = in_thread(lambda: run(cfg))

    def wait(condition, what: str):
        value = wait_for(condition, running)  # bounded (goodput.WAIT_S)
        if value is None:
            raise RuntimeError(f"{preset}: the run ended before {what} (its traceback is above)")
        return value

    # the committed checkpoint: under restart the one Ray Train registered, under replica the run folder's record
    def committed() -> bool:
        latest = read_commit_ack(root) if mode == "restart" else read_latest(root)
        return bool(latest) and step_of(latest) >= 3

    wait(committed, "its first commit")
    run_id = Path(root, "mlflow_run_id").read_text().strip()
    client = MlflowClient(cfg.tracking.uri)

    def step_times() -> list[float]:
        return [m.value for m in client.get_metric_history(run_id, "train_live/step_time_s") if m.step > 3]

    wait(lambda: len(step_times()) >= steps_after, f"{steps_after} steps after its first commit")
    times = step_times()
    drained_at = time.time()
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run(
        [ray_cli, "drain-node", "--address", cluster.address, "--node-id", node.node_id, "--reason",
         "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "benchmark", "--deadline-remaining-seconds", "30"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    cli_s = time.time() - drained_at
    recorder = MlflowRecorder(cfg.tracking.uri, run_id)
    event = wait(lambda: next((e for e in recorder.events() if e["kind"] == "preemption"), None), "a preemption event")
    # the newest checkpoint: under restart the one saved after the notice, under replica the last periodic one
    step_dir = os.path.join(root, f"step-{complete_steps(root)[-1]}")  # a folder being written is not counted
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(step_dir) for f in fs)
    return {
        "notice_to_committed_s": event["notice_to_committed_s"],
        "drain_to_committed_s": event["time"] - drained_at,
        "drain_to_notice_s": event["notice_time"] - drained_at,
        "drain_cli_s": cli_s,
        "checkpoint": event["checkpoint"],
        "step_time_s_median": statistics.median(times),
        "checkpoint_bytes": size,
        "step_saved": event["step_saved"],
        "share_of_window": {k: (event["time"] - drained_at) / w for k, w in WINDOWS_S.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--steps-after", type=int, default=2, help="steps trained after the first commit, before the drain")
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # internal: run one mode and preset, print its JSON
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="result file (default: benchmarks/results/preemption.json)")
    args = p.parse_args()
    if args.one:
        mode, preset = args.one
        one(mode, preset, args.workdir, args.steps_after)
        os._exit(0)  # the stopped run's driver thread does not end by itself

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import default_out, report, scratch

    result: dict = {"windows_s": WINDOWS_S}
    for mode in args.modes:
        result[mode] = {}
        for preset in args.presets:
            workdir = scratch(f"preempt-{mode}-{preset}-")
            env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
            cmd = [sys.executable, __file__, "--one", mode, preset, "--workdir", workdir]
            cmd += ["--steps-after", str(args.steps_after)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, start_new_session=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:  # reported, and the other runs still measured
                print(f"{mode} {preset}: no result (exit {out.returncode})\n{out.stderr[-3000:]}", file=sys.stderr)
                result[mode][preset] = {"failed": out.stderr.strip().splitlines()[-1:], "returncode": out.returncode}
                continue
            result[mode][preset] = json.loads(line[len("RESULT ") :])
    report(result, args.out or default_out("preemption"))


if __name__ == "__main__":
    main()
