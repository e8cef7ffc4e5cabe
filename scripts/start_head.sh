#!/usr/bin/env bash
# Start a single-machine Ray head as the demo does (tests/test_jobs.py starts its head with this
# script too). Arguments are passed on to `ray start` (ports, --temp-dir, --block).
# - Token authentication on: RAY_AUTH_MODE=token with the token Ray keeps at ~/.ray/auth_token
#   (made here if it is missing) or the one RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH gives.
# - Loopback only: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's single-machine mode (its default on
#   macOS and Windows): the node's address is 127.0.0.1 and every Ray process of the head listens
#   there (`--node-ip-address=127.0.0.1` alone is turned back into the network address by Ray).
#   Clients on the same machine need the same setting to connect as drivers; `ray job submit` does not.
# - RAY_num_workers_soft_limit: raytrain_ft.launch.driver.RAY_NODE_ENV. RAY_JOB_STOP_WAIT_TIME_S:
#   `ray job stop`'s grace from SIGTERM to SIGKILL (Ray's 3 s cut short the driver's ending: its
#   MLflow flush and the KILLED status).
# What listens where, and why: docs/cluster.md#security.
set -euo pipefail
export RAY_AUTH_MODE=token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
if [ -z "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ]; then
  ray get-auth-token --generate >/dev/null  # it prints the token: kept off the terminal
fi
RAY_num_workers_soft_limit=16 RAY_JOB_STOP_WAIT_TIME_S=30 exec ray start --head --num-cpus=2 \
  --dashboard-host=127.0.0.1 --disable-usage-stats "$@"
