"""The default tracking store on a 2-node local cluster (`ray.cluster_utils.Cluster`).

Run by tests/test_tracking.py in a subprocess (a Cluster needs a process without another Ray
instance). Usage: python tracking_cluster.py WORKDIR (also the driver's home folder). With `tracking.uri` empty and no
`MLFLOW_TRACKING_URI`, `tracking_store` starts `mlflow server`; a task pinned to each node logs a
run and an artifact through the URI the workers would get, with the credentials the job's runtime
env gives them (the nodes' own environment has none), and a request without them is refused. Prints
one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import ray
from mlflow.tracking import MlflowClient
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ft.launch.driver import job_runtime_env
from raytrain_ft.launch.tracking_server import CREDENTIALS, tracking_store


@ray.remote(num_cpus=0.1)
def probe(uri: str) -> dict:
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment(f"probe-{ray.get_runtime_context().get_node_id()[:8]}"))
    client.log_text(run.info.run_id, "reached", "probe.txt")
    return {"node": ray.get_runtime_context().get_node_id(), "artifact_uri": run.info.artifact_uri}


def status_without_credentials(uri: str) -> int:
    try:
        with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def main(workdir: str) -> None:
    for k in ("MLFLOW_TRACKING_URI", *CREDENTIALS):  # the nodes start without credentials
        os.environ.pop(k, None)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False, runtime_env=job_runtime_env())  # as jobs/pretrain.py
    os.chdir(workdir)
    os.environ["HOME"] = workdir  # the default store is $HOME/raytrain-ft/mlflow.db
    try:
        with tracking_store("") as uri:
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            head = next(n["NodeManagerAddress"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"])
            pinned = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)) for n in nodes]
            reached = ray.get([p.remote(uri) for p in pinned], timeout=300)
            refused = status_without_credentials(uri)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps({"uri": uri, "head_address": head, "nodes": nodes, "reached": reached, "refused": refused}))


if __name__ == "__main__":
    main(sys.argv[1])
