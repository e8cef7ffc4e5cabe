"""Where a run tracks to while it trains, when `tracking.uri` is empty and `MLFLOW_TRACKING_URI` is unset.

The store is `sqlite:///$HOME/raytrain-ft/mlflow.db` on the driver's machine (`tracking.resolve_uri`),
however the job was started, so `raytrain-ft history NAME` on that machine finds the run.

- A single-node Ray instance (what `python jobs/pretrain.py` starts): every worker opens that file.
- A cluster of several nodes, or a running cluster this job joined (`RAY_ADDRESS`; it may grow):
  a SQLite path is a different or missing file on every other node. The driver, which runs on the
  head, starts `mlflow server` there (SQLite backend in the same file, artifact serving into
  `mlartifacts/` beside it) and gives the workers its `http://` URI. The server runs MLflow's
  basic-auth app and answers only requests with the job's credentials (`tracking_credentials`,
  which the job passes to every worker in its runtime env); it binds to the head's
  cluster-internal address (the address Ray uses for the node), never to every interface, and
  stops with the job. For a server that outlives jobs (and the UI), run your own and set `tracking.uri`.

Under `ray job submit --working-dir .` the driver's folder is Ray's temporary copy of the working
directory, deleted when Ray cleans up (a resubmission with changed code even gets a new one): a
relative `run.storage_path` or `data.path` is refused (`lasting_path`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

import ray

from raytrain_ft.core.errors import ConfigError, UserError
from raytrain_ft.telemetry.tracking import resolve_uri

RAY_WORKING_DIR_MARK = os.sep + os.path.join("runtime_resources", "working_dir_files") + os.sep
SERVER_START_TIMEOUT_S = 180.0
CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")  # what MLflow's client sends
USERNAME = "raytrain-ft"
AUTH_CACHE_S = 600  # the server's cache of a verified password (one user; its users die with it)


def tracking_credentials() -> dict[str, str]:
    """The HTTP basic-auth credentials of MLflow clients, as MLflow reads them from the environment
    (`MLFLOW_TRACKING_USERNAME`, `MLFLOW_TRACKING_PASSWORD`): the environment's when both are set (a
    user's own server's, or those a job was given); else user `raytrain-ft` with a new random password
    (`secrets.token_urlsafe(32)`: 256 bits), set in `os.environ` for this process and its children.
    Never written to disk. The job's runtime env carries them to every worker and actor
    (`launch.driver.job_runtime_env`); the server `mlflow_server` starts admits only them."""
    if not all(os.environ.get(k) for k in CREDENTIALS):
        os.environ.update(dict(zip(CREDENTIALS, (USERNAME, secrets.token_urlsafe(32)), strict=True)))
    return {k: os.environ[k] for k in CREDENTIALS}


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

    The server runs MLflow's basic-auth app (`--app-name basic-auth`): every request but `/health`
    needs the credentials of `tracking_credentials()` (its admin user; HTTP 401 without them). Its
    user store is a SQLite file in a private temporary folder made for this server and removed with
    it, so a password never outlives the server that admits it.

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
    cmd += ["--app-name", "basic-auth"]
    user, password = (tracking_credentials()[k] for k in CREDENTIALS)
    auth_dir = tempfile.mkdtemp(prefix="mlflow-auth-")  # mode 0700
    config = os.path.join(auth_dir, "basic_auth.ini")
    with open(config, "w") as f:
        f.write(
            f"[mlflow]\ndefault_permission = NO_PERMISSIONS\ndatabase_uri = sqlite:///{auth_dir}/users.db\n"
            f"admin_username = {user}\nauthorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
            # one PBKDF2 check per AUTH_CACHE_S, not per request (tens of ms of CPU each: with one check
            # per request, the recorder's requests took the CPU the workers train with on 2 cores, and
            # tests/test_recovery.py's healthy steps tripped its 10 s hang timeout)
            f"auth_cache_ttl_seconds = {AUTH_CACHE_S}\n"
        )
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",  # no GenAI job runner processes
        "MLFLOW_AUTH_CONFIG_PATH": config,
        "MLFLOW_AUTH_ADMIN_PASSWORD": password,  # read once, when the empty user store gets its admin
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),  # the auth app's CSRF key
    }
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
        shutil.rmtree(auth_dir, ignore_errors=True)


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
