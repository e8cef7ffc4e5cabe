"""A drain notice for preemption under replica recovery on a 2-node local cluster
(`ray.cluster_utils.Cluster`) at exact fit: a head (the driver, Train controller, torchft lighthouse
and recorder, 0-CPU actors) and a worker node, 1 CPU each, one replica of 1 CPU on each.

Run by tests/test_preemption.py in a subprocess (a Cluster needs a process without another Ray
instance). Usage: python replica_preemption.py DATASET WORKDIR. Once step `DRAIN_AFTER` is committed,
the worker node is drained with reason preemption and a deadline of `DEADLINE_S`; once its
`preemption` event is recorded a new 1-CPU node joins (capacity returns) and the drained node goes
(as the cloud takes it). Prints one JSON line: the run id, whether `run` returned it, the drained
node and the replica on it, the drain's time (the `ray drain-node` call and its return) and
deadline, both replicas' worker records before the drain and at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster
from scenarios.local_cluster import HEAD_NODE_ARGS

from raytrain_ft.core.config import Config
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.run_folder import read_latest, step_of, worker_records
from raytrain_ft.launch.driver import WORKER_ENV, run
from raytrain_ft.launch.ray_start import RAY_NODE_ENV
from raytrain_ft.telemetry.tracking import MlflowRecorder

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 55
DRAIN_AFTER = 5
DEADLINE_S = 60


def replica_preemption_config(dataset: str, workdir: str) -> Config:
    """The scenario's run config (the test reads the same one)."""
    return load_config(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [
            f"data.path={dataset}",
            f"run.storage_path={workdir}/runs",
            f"tracking.uri=sqlite:///{workdir}/mlflow.db",
            "run.name=replica-preemption",
            "failure.recovery=replica",
            f"train.max_steps={STEPS}",
            # steps of a steady 0.5 s: the survivor still trains when the replacement arrives (it joined
            # 11-12 s after the drained replica left, at step 23-30; 55 steps leave room for about twice that)
            f"faults=[{{kind: slow, step: 1, steps: {STEPS}, seconds: 0.5, rank: -1}}]",
            "checkpoint.interval_steps=5",
            "scaling.cpus_per_worker=1",  # one replica per 1-CPU node
            "failure.max_failures=3",
            "data.audit=true",
        ],
    )


def wait(what: str, condition, trainer: threading.Thread, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and trainer.is_alive():
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout_s} s (run alive: {trainer.is_alive()})")


def main(dataset: str, workdir: str) -> None:
    os.environ.update({**RAY_NODE_ENV, **WORKER_ENV})
    cluster = Cluster(initialize_head=True, head_node_args=HEAD_NODE_ARGS)
    worker_node = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, runtime_env={"env_vars": WORKER_ENV}, log_to_driver=False)
    cfg = replica_preemption_config(dataset, workdir)
    root = os.path.join(workdir, "runs", "replica-preemption")
    result: dict = {}
    trainer = threading.Thread(target=lambda: result.update(run_id=run(cfg)), daemon=True)
    trainer.start()
    committed = lambda: (latest := read_latest(root)) is not None and step_of(latest) >= DRAIN_AFTER  # noqa: E731
    wait(f"the commit of step {DRAIN_AFTER}", committed, trainer)
    before = worker_records(root, 2, 0.0)
    run_id = Path(root, "mlflow_run_id").read_text().strip()
    node = worker_node.node_id
    [replica] = [r for r, record in before.items() if record["node_id"] == node]
    drained_at = time.time()
    subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "drain-node",
            "--address",
            cluster.address,
            "--node-id",
            node,
            "--reason",
            "DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message",
            "spot reclaim (test)",
            "--deadline-remaining-seconds",
            str(DEADLINE_S),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    drain_returned = time.time()
    recorder = MlflowRecorder(cfg.tracking.uri, run_id)
    wait("the preemption event", lambda: any(e["kind"] == "preemption" for e in recorder.events()), trainer)
    # a node with room for a replica joins (its start is not on the replacement's path), then the cloud
    # takes the drained one
    cluster.add_node(num_cpus=1)
    cluster.remove_node(worker_node, allow_graceful=False)
    trainer.join(timeout=600)
    print(
        json.dumps(
            {
                "run_id": run_id,
                "finished": result.get("run_id") == run_id,
                "node": node,
                "replica": replica,
                "drained_at": drained_at,
                "drain_returned": drain_returned,
                "deadline_s": DEADLINE_S,
                "before": before,
                "after": worker_records(root, 2, 0.0),
            }
        )
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
