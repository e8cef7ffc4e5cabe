"""How raytrain-ft starts Ray: the environment Ray's own processes read, and a single-machine start.

Secure by default (docs/cluster.md#security): every Ray instance runs with token authentication
(Ray's default for a local `ray.init` since 2.59, with the token at `~/.ray/auth_token`, made if
missing; `scripts/start_head.sh`, the cluster files and the tests set `RAY_AUTH_MODE=token`
explicitly). The demo's head also listens on 127.0.0.1 only (`scripts/start_head.sh`: Ray's
single-machine mode, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which Ray reads when it is imported,
so a process that has imported Ray cannot switch it on for the instance it starts: `start` below
keeps Ray's default addresses, token-authenticated).
"""

from __future__ import annotations

import os
from typing import Any

import ray

# Ray kills a node's idle worker processes beyond its *available* CPUs after 1 s (ray-project/ray#36766).
# The training workers reserve the CPUs, so the 0-CPU read tasks of Ray Data (launch/datasource.py)
# lost their idle workers between tasks, and after every restart the raylet started new Python
# processes for them: ~1 s of CPU each on the recovery's critical path (benchmarks/goodput.py; a
# profile showed two per restart). Every raylet keeps this many idle workers instead. Read by the
# raylet from its environment: set where Ray starts (`scripts/start_head.sh` and the cluster files;
# `start` below, and the tests, before a local `ray.init`).
RAY_NODE_ENV = {"RAY_num_workers_soft_limit": "16"}


def start(num_cpus: int | None = None, include_dashboard: bool = False, **init: Any) -> None:
    """`ray.init` for a job: join the cluster `RAY_ADDRESS` names (`ray job submit` sets it), else start
    a Ray of this machine alone (`num_cpus` logical CPUs, Ray's count if None) with `RAY_NODE_ENV` and
    token authentication. `init`: further `ray.init` arguments (`runtime_env`, ...)."""
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**init)
        return
    os.environ.update(RAY_NODE_ENV)  # token authentication: Ray's default for a new local instance
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=include_dashboard, **init)
