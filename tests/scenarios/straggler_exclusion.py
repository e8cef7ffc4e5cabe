"""A straggler excluded (`straggler.action: exclude`) on a local multi-node cluster
(`ray.cluster_utils.Cluster`, 1-CPU nodes, one worker each): rank 1 sleeps `SLOW_S` in its own compute
of steps 1 to `SLOW_STEPS`, is flagged, and is excluded `EXCLUDE_AFTER` steps after its flag.

* `restart`: 3 nodes (the head included), 3 workers of an elastic range [2, 3]; the attempt ends at
  the exclusion's step and the driver starts the next group without the excluded node (2 workers).
* `replica`: 2 nodes, 2 replicas; the excluded replica leaves the quorum and Ray Train replaces it;
  from step `SLOW_STEPS + 1` every rank sleeps `PACE_S` per step, so the survivor still trains when
  the replacement arrives.

Run by tests/test_straggler_exclusion.py in a subprocess (a Cluster needs a process without another
Ray instance). Usage: python straggler_exclusion.py MODE DATASET WORKDIR. Prints one JSON line: the
run id, whether `run` returned it, the workers' records (`run_folder.worker_records`: rank -> pid,
node id, start time) of the first attempt and at the end, and the run folder's exclusion records.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import ray
from ray.cluster_utils import Cluster

from raytrain_ft.core.config import Config
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.run_folder import read_exclusions, run_root, worker_records
from raytrain_ft.launch.driver import WORKER_ENV, run
from raytrain_ft.launch.ray_start import RAY_NODE_ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLOW_S, SLOW_STEPS, EXCLUDE_AFTER, PACE_S = 0.3, 14, 3, 0.5
# replica: the replacement joined 8-12 s after the exclusion (step 22-24); from there the survivor's
# `PACE_S` steps leave it about 13 s more
STEPS = {"restart": 24, "replica": 50}
WORKERS = {"restart": 3, "replica": 2}


def exclusion_config(mode: str, dataset: str, workdir: str) -> Config:
    """The scenario's run config (the test reads the same one)."""
    faults = f"{{kind: slow, rank: 1, seconds: {SLOW_S}, step: 1, steps: {SLOW_STEPS}}}"
    if mode == "replica":
        faults += f", {{kind: slow, rank: -1, seconds: {PACE_S}, step: {SLOW_STEPS + 1}, steps: {STEPS[mode]}}}"
    per_mode = (
        ["scaling.num_workers=[2,3]", "scaling.cpus_per_worker=0.8", "failure.group_start_timeout_s=5"]
        if mode == "restart"
        else ["failure.recovery=replica", "scaling.num_workers=2", "scaling.cpus_per_worker=1"]
    )
    return load_config(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [
            f"data.path={dataset}",
            f"run.storage_path={workdir}/runs",
            f"tracking.uri=sqlite:///{workdir}/mlflow.db",
            f"run.name=exclusion-{mode}",
            f"train.max_steps={STEPS[mode]}",
            "train.global_batch_size=8",
            "checkpoint.interval_steps=5",
            "straggler.action=exclude",
            f"straggler.exclude_after_steps={EXCLUDE_AFTER}",
            f"faults=[{faults}]",
            "failure.max_failures=3",
            "data.audit=true",
            *per_mode,
        ],
    )


def main(mode: str, dataset: str, workdir: str) -> None:
    os.environ.update({**RAY_NODE_ENV, **WORKER_ENV})
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(WORKERS[mode] - 1):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, runtime_env={"env_vars": WORKER_ENV}, log_to_driver=False)
    cfg = exclusion_config(mode, dataset, workdir)
    root = run_root(cfg.run.storage_path, cfg.run.name)
    result: dict = {}
    started = time.time()
    trainer = threading.Thread(target=lambda: result.update(run_id=run(cfg)), daemon=True)
    trainer.start()
    first = None
    while first is None and trainer.is_alive():
        first = worker_records(root, WORKERS[mode], started)
        time.sleep(0.2)
    trainer.join(timeout=600)
    exclusions = read_exclusions(root, started)
    print(
        json.dumps(
            {
                "run_id": result.get("run_id"),
                "finished": "run_id" in result,
                "first": first,
                # restart: the next attempt's group; replica: the survivor's record and its replacement's
                "last": worker_records(root, WORKERS[mode] - 1, exclusions[-1]["time"])
                if exclusions and mode == "restart"
                else worker_records(root, WORKERS[mode], 0.0),
                "exclusions": exclusions,
            }
        )
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
