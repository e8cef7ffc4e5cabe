"""Preemption notice, elastic shrink and grow-back on a 3-node local cluster (`ray.cluster_utils.Cluster`),
one worker per node, at a world size (3) that divides neither the global batch of 8 nor its 4 lanes.

Run by tests/test_elastic.py in a subprocess (a Cluster needs a process without another Ray
instance). Usage: python elastic.py DATASET WORKDIR. Prints one JSON line with what happened: the run
id, whether `run` returned it, the `world_size` metric's values (each attempt logs it once, oldest first)
just before the node was added back and at the end, and the drained node, when and with what deadline.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
from mlflow.tracking import MlflowClient
from ray.cluster_utils import Cluster
from scenarios.local_cluster import HEAD_NODE_ARGS

from raytrain_ft.core.config import Config
from raytrain_ft.core.config_files import load_config
from raytrain_ft.launch.driver import WORKER_ENV, run
from raytrain_ft.telemetry.tracking import MlflowRecorder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def world_sizes(uri: str, run_id: str) -> list[int]:
    history = MlflowClient(uri).get_metric_history(run_id, "world_size")
    return [int(m.value) for m in sorted(history, key=lambda m: m.timestamp)]


def elastic_config(dataset: str, workdir: str) -> Config:
    """The scenario's run config (the test reads the same one)."""
    return load_config(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [
            f"data.path={dataset}",
            f"run.storage_path={workdir}/runs",
            f"tracking.uri=sqlite:///{workdir}/mlflow.db",
            "run.name=elastic",
            # the grow-back comes at about step 35 (preemption notice after the step-10 commit, the shrink, the
            # node added back, the next resize check, the restart): 20 steps of margin, ~15 s
            "train.max_steps=55",
            # steps of a steady 0.6 s that leave the CPUs to Ray: the run outlasts the shrink and the grow-back
            "faults=[{kind: slow, step: 1, steps: 55, seconds: 0.6, rank: -1}]",
            "train.global_batch_size=8",
            "checkpoint.interval_steps=10",
            "scaling.num_workers=[2,3]",
            # Ray's default 60 s between grow-back checks can outlast the ~50 s of training left after the shrink
            "scaling.resize_check_interval_s=5",
            "scaling.cpus_per_worker=0.8",  # one worker per 1-CPU node, 0.2 CPU left for Ray Data
            "failure.max_failures=5",
            # shrink sooner after a node loss: Ray Train waits this long for the placement group of the largest
            # size (3) before trying 2 (default 60 s); a group of free resources is ready in under 1 s
            "failure.group_start_timeout_s=5",
            "data.audit=true",
            # the memory tier on: a resized group finds only copies of another world size, skips them
            # (recorded) and restores the durable checkpoint (docs/memory-tier.md)
            "checkpoint.memory.interval_steps=3",
            f"checkpoint.memory.dir={workdir}/shm",
        ],
    )


def main(dataset: str, workdir: str) -> None:
    env = WORKER_ENV
    os.environ.update(env)
    cluster = Cluster(initialize_head=True, head_node_args=HEAD_NODE_ARGS)
    cluster.add_node(num_cpus=1)
    worker_node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, runtime_env={"env_vars": env}, log_to_driver=False)
    cfg = elastic_config(dataset, workdir)
    run_root = os.path.join(workdir, "runs", "elastic")
    result: dict = {}
    trainer = threading.Thread(target=lambda: result.update(run_id=run(cfg)))
    trainer.start()
    # Cluster changes must come from the main thread (Ray installs signal handlers there).
    snapshot = Path(run_root, "checkpoint_manager_snapshot.json")
    while not (snapshot.exists() and '"step-10"' in snapshot.read_text()):
        time.sleep(0.5)
    run_id = Path(run_root, "mlflow_run_id").read_text().strip()
    # A spot reclaim notice for the worker node (what the autoscaler sends on preemption) ...
    drained_at = time.time()
    subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "drain-node",
            "--address",
            cluster.address,
            "--node-id",
            worker_node.node_id,
            "--reason",
            "DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message",
            "spot reclaim (test)",
            "--deadline-remaining-seconds",
            "120",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    drain_returned = time.time()
    logger = MlflowRecorder(cfg.tracking.uri, run_id)
    while not (notices := [e for e in logger.events() if e["kind"] == "preemption"]):
        time.sleep(0.5)
    # the group trains on at 3 until the node goes: wait for a committed memory copy newer than the
    # step saved for the notice, which the shrunk group must pass over (another world size)
    saved = notices[0]["step_saved"]
    while not any(
        int(p.split("step-")[-1].split("/")[0]) > saved for p in glob.glob(f"{workdir}/shm/*/*/rank-*/step-*/COMMITTED")
    ):
        time.sleep(0.2)
    # ... then the node goes.
    cluster.remove_node(worker_node, allow_graceful=False)
    while 2 not in world_sizes(cfg.tracking.uri, run_id) and trainer.is_alive():
        time.sleep(1)
    sizes_before_add = world_sizes(cfg.tracking.uri, run_id)  # what was observed, not what was done
    cluster.add_node(num_cpus=1)
    trainer.join()
    print(
        json.dumps(
            {
                "run_id": run_id,
                "finished": result.get("run_id") == run_id,
                "world_sizes_before_add": sizes_before_add,
                "world_sizes": world_sizes(cfg.tracking.uri, run_id),
                "drained": {
                    "node": worker_node.node_id,
                    "at": drained_at,
                    "returned": drain_returned,
                    "deadline_s": 120,
                },
            }
        )
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
