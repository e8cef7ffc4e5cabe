"""Where a run tracks to while it trains, when `tracking.uri` is empty and `MLFLOW_TRACKING_URI` is unset.

The store is `sqlite:///$HOME/raytrain-ft/mlflow.db` on the driver's machine (`tracking.resolve_uri`),
however the job was started, so `raytrain-ft history NAME` on that machine finds the run.

- A single-node Ray instance (what `python jobs/pretrain.py` starts): every worker opens that file.
- A cluster of several nodes, or a running cluster this job joined (`RAY_ADDRESS`; it may grow):
  a SQLite path is a different or missing file on every other node. The driver, which runs on the
  head, starts `mlflow server` there (SQLite backend in the same file, artifact serving into
  `mlartifacts/` beside it) and gives the workers its `http://` URI. The server has no
  authentication: it binds to the head's cluster-internal address (the address Ray uses for the
  node), never to every interface, and stops with the job.
  For a server that outlives jobs (and the UI), run your own and set `tracking.uri`.

Under `ray job submit --working-dir .` the driver's folder is Ray's temporary copy of the working
directory, deleted when Ray cleans up (a resubmission with changed code even gets a new one): a
relative `run.storage_path` or `data.path` is refused (`lasting_path`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import ray

from raytrain_ft.errors import ConfigError, UserError
from raytrain_ft.telemetry.tracking import resolve_uri

RAY_WORKING_DIR_MARK = os.sep + os.path.join("runtime_resources", "working_dir_files") + os.sep
SERVER_START_TIMEOUT_S = 180.0


def ray_working_dir() -> str | None:
    """The current folder if it is Ray's temporary copy of a job's `--working-dir`, else None."""
    cwd = os.getcwd()
    return cwd if RAY_WORKING_DIR_MARK in cwd + os.sep else None


def lasting_path(path: str, key: str) -> str:
    """`path` made absolute (Ray workers run in other folders); URLs unchanged.

    Raises:
        ConfigError: `path` is relative and the current folder is Ray's temporary working-dir copy.
    """
    if "://" in path or os.path.isabs(path):
        return path
    temporary = ray_working_dir()
    if temporary:
        raise ConfigError(
            f"{key}={path} would resolve to {os.path.join(temporary, path)}, inside Ray's temporary copy of "
            "--working-dir, which Ray deletes; give an absolute path or a URL every node reaches"
        )
    return os.path.abspath(path)


@contextlib.contextmanager
def tracking_store(configured: str) -> Iterator[str]:
    """The tracking URI for the driver and every worker while the run trains (see the module docstring)."""
    uri = resolve_uri(configured)
    if configured or os.environ.get("MLFLOW_TRACKING_URI") or not _shared_cluster():
        yield uri  # MLflow creates a SQLite store's folder
        return
    default_dir = os.path.dirname(uri[len("sqlite:///") :])
    os.makedirs(default_dir, exist_ok=True)
    with mlflow_server(uri, os.path.join(default_dir, "mlartifacts"), ray.util.get_node_ip_address()) as url:
        yield url


def _shared_cluster() -> bool:
    return bool(os.environ.get("RAY_ADDRESS")) or sum(n["Alive"] for n in ray.nodes()) > 1


@contextlib.contextmanager
def mlflow_server(backend_uri: str, artifacts: str, host: str, port: int = 0) -> Iterator[str]:
    """Run `mlflow server` (backend `backend_uri`, artifacts served from the folder `artifacts`) on
    `host` at `port` (0: a free one); yield its `http://host:port` URI once `/health` answers; stop it after.

    Raises:
        UserError: the server exited or did not answer within `SERVER_START_TIMEOUT_S` (its log's path).
    """
    if not port:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    url = f"http://{host}:{port}"
    log_path = os.path.join(os.path.dirname(artifacts), "mlflow-server.log")
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port)]
    cmd += ["--backend-store-uri", backend_uri, "--serve-artifacts", "--artifacts-destination", artifacts]
    # MLflow's DNS-rebinding guard admits only localhost and private ranges by default; a cluster's
    # internal address may be neither
    cmd += ["--workers", "1", "--allowed-hosts", f"{host},{host}:{port},localhost,localhost:{port}"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no GenAI job runner processes
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise UserError(f"the MLflow server for this run did not start on {url}; see {log_path}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's session (the CLI process and its uvicorn worker), SIGKILL after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
