"""The memory tier on a multi-node local cluster (`ray.cluster_utils.Cluster`): a node lost, a process
killed, both copies of a shard damaged, in one run.

Run by tests/test_memory_tier.py in a subprocess (a Cluster needs a process without another Ray instance).
Usage: python memory_tier.py DATASET WORKDIR. A head without CPUs (no worker on it, so a worker's node can
always be removed) and two 1-CPU nodes, one worker each; memory checkpoints every 3 steps, durable ones
every 10. The run's faults are pauses at which this script acts, after the injected fault settled both
tiers (the steps resumed from do not depend on timing):

1. rank 1 hangs in step 14: its node is removed (`remove_node`, its raylet killed: its keeper and its
   copies go with it) and a new node is added; the run resumes from memory step 12, rank 1's state
   from its peer copy on the surviving node;
2. rank 0 is killed before step 20 (a `kill` fault): both nodes live, the run resumes from memory step 18;
3. rank 1 hangs in step 26: a bit of rank 0's copy of step 24 is flipped on both nodes that hold it, then
   rank 1's process is killed; rank 0 has no intact copy, so every rank falls back to the durable
   checkpoint of step 20, and each damaged copy is recorded.

Prints one JSON line: the run id and the removed node.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import threading
import time

import ray
from ray.cluster_utils import Cluster
from scenarios.local_cluster import HEAD_NODE_ARGS

from conftest import flip_bit
from raytrain_ft.core.config import Config
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.run_folder import worker_records
from raytrain_ft.launch.driver import WORKER_ENV, run
from raytrain_ft.resilience.faults import fired

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG = "{kind: hang, step: %d, rank: 1, seconds: 600}"
SLOW = "{kind: slow, step: 1, steps: 30, seconds: 0.5, rank: -1}"


def memory_config(dataset: str, workdir: str) -> Config:
    """The scenario's run config (the test reads the same one): the resume tests' `GUARDED` settings."""
    return load_config(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [
            f"data.path={dataset}",
            f"run.storage_path={workdir}/runs",
            f"tracking.uri=sqlite:///{workdir}/mlflow.db",
            "run.name=memory",
            "train.max_steps=30",
            "data.audit=true",
            "guards.fingerprint.interval_steps=7",
            "guards.rank_check.interval_steps=1",
            "guards.on_alert=restart",
            "checkpoint.interval_steps=10",
            "checkpoint.memory.interval_steps=3",
            f"checkpoint.memory.dir={workdir}/shm",
            # steps of a steady 0.5 s (as on a GPU node): each memory copy is written and replicated within
            # its 3-step interval, so none is skipped for one still in flight
            f"faults=[{HANG % 14}, {{kind: kill, step: 20, rank: 0}}, {HANG % 26}, {SLOW}]",
            "scaling.cpus_per_worker=0.8",  # one worker per 1-CPU node, 0.2 CPU left for Ray Data
            "failure.max_failures=5",
            "failure.group_start_timeout_s=5",
        ],
    )


def wait(what: str, condition, trainer: threading.Thread, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        if not trainer.is_alive() or time.time() > deadline:
            print(f"gave up waiting for {what}", file=sys.stderr, flush=True)
            os._exit(1)  # the run's thread would keep the process alive
        time.sleep(0.2)


def committed_copies(workdir: str, rank: int, step: int) -> list[str]:
    """The folders holding a committed copy of (rank, step), on any node (read here by the test's driver,
    which sees the one machine's files; the run itself reads other nodes' only through their keepers)."""
    return [os.path.dirname(p) for p in glob.glob(f"{workdir}/shm/*/*/rank-{rank}/step-{step}/COMMITTED")]


def main(dataset: str, workdir: str) -> None:
    os.environ.update(WORKER_ENV)
    cluster = Cluster(initialize_head=True, head_node_args={**HEAD_NODE_ARGS, "num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=cluster.address, runtime_env={"env_vars": WORKER_ENV}, log_to_driver=False)
    cfg = memory_config(dataset, workdir)
    root = os.path.join(workdir, "runs", "memory")
    result: dict = {}
    trainer = threading.Thread(target=lambda: result.update(run_id=run(cfg)))
    started = time.time()
    trainer.start()

    # 1. rank 1 hangs in step 14 (memory step 12 committed on both nodes): its node goes, a new one comes
    wait("the hang at step 14", lambda: fired(root, 0, 14) and len(committed_copies(workdir, 1, 12)) == 2, trainer)
    records = worker_records(root, 2, started)
    assert records is not None
    doomed = next(n for n in nodes if n.node_id == records[1]["node_id"])
    cluster.remove_node(doomed, allow_graceful=False)
    cluster.add_node(num_cpus=1)

    # 3. rank 1 hangs in step 26 (memory step 24 committed): rank 0's copies of step 24 damaged, rank 1 killed
    wait("the hang at step 26", lambda: fired(root, 2, 26) and len(committed_copies(workdir, 0, 24)) == 2, trainer)
    for folder in committed_copies(workdir, 0, 24):
        flip_bit(folder, "model.model.embed_tokens.weight")
    paused = time.time()
    records = worker_records(root, 2, started)
    assert records is not None
    os.kill(records[1]["pid"], signal.SIGKILL)
    trainer.join()
    print(json.dumps({"run_id": result.get("run_id"), "removed_node": doomed.node_id, "paused": paused}))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
