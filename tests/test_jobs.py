"""The job entry points as users run them: `python jobs/pretrain.py` for the user errors, and on one
head started as the demo starts it (`scripts/start_head.sh`) for the module: `ray job submit`, `ray job
stop`, a dead driver, resubmission; and that head's security: loopback only, no client without its token."""

from __future__ import annotations

import contextlib
import glob
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from mlflow.tracking import MlflowClient
from ray.job_submission import JobStatus, JobSubmissionClient

from conftest import REPO, copy_steps, events, free_port, make_config, sqlite_store
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.launch.driver import preflight

PRETRAIN = os.path.join(REPO, "jobs", "pretrain.py")
TINY = os.path.join(REPO, "configs", "tiny.yaml")
BIN = os.path.dirname(sys.executable)
ENV = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}  # with the session's Ray token (conftest)


def run_args(tmp_path, dataset, *extra):
    return [
        f"data.path={dataset}",
        f"run.storage_path={tmp_path / 'runs'}",
        f"tracking.uri={sqlite_store(tmp_path)}",
        *extra,
    ]


def pretrain(*args, timeout=300):
    return subprocess.run(
        [sys.executable, PRETRAIN, "--config", TINY, *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_unknown_config_key_is_one_line_error(tmp_path, dataset):
    r = pretrain(*run_args(tmp_path, dataset, "train.max_stepz=3"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: unknown config key 'train.max_stepz'; did you mean 'train.max_steps'?"
    ]


def test_missing_dataset_is_one_line_error(tmp_path, dataset):
    r = pretrain(*run_args(tmp_path, tmp_path / "nowhere"))
    assert r.returncode == 2
    # the whole output: the preflight ran before any Ray start (whose log lines would come first)
    assert r.stderr.strip().splitlines() == [
        f"error: no prepared dataset at {tmp_path / 'nowhere'} (manifest.json missing); run "
        f"`python jobs/prepare_data.py --output {tmp_path / 'nowhere'}` or set data.path"
    ]


def test_a_model_config_that_is_not_a_causal_lm_is_one_line_error(tmp_path, dataset):
    t5 = tmp_path / "t5.json"
    t5.write_text(json.dumps({"model_type": "t5", "vocab_size": 512, "d_model": 64}))
    r = pretrain(*run_args(tmp_path, dataset, f"model.hf_config={t5}"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: config key 'model.hf_config': {t5} is a t5 config, which AutoModelForCausalLM does not build; "
        "give a decoder-only causal LM (qwen2, mistral, gpt_neox, ...)"
    ]


def test_a_gpu_run_on_a_cluster_without_gpus_names_use_gpu(tmp_path, dataset, ray_local):
    cfg = make_config(tmp_path, dataset, "scaling.use_gpu=true")
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert str(e.value) == (
        "scaling.num_workers=2 needs 2 GPU but the Ray cluster has 0; "
        "lower scaling.num_workers or set scaling.use_gpu=false, or add GPU nodes"
    )


def kill_session(sid: int) -> None:
    """SIGKILL every process of a session (the head started below and what it started), nothing else:
    `ray stop` would also stop the Ray instance of this test process."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Head(NamedTuple):
    address: str  # the dashboard's (job submission) http:// address
    temp_dir: str  # its --temp-dir
    session: int  # the session id of its processes


@contextlib.contextmanager
def started_head() -> Iterator[Head]:
    """A head started by the demo's own `scripts/start_head.sh` (2 CPUs, token auth, loopback), a cluster
    of its own; yields it once it has run a job, stops it after.

    Only the dashboard's port is chosen here; Ray binds every other port itself (0), since a port
    picked free here can be taken by a worker of the test session's own Ray before the head binds it.
    Its own `--temp-dir` keeps it apart from that Ray's `/tmp/ray`. The dashboard answers before its
    job agent has registered (Ray's submit then fails with "No available agent ... try again later"),
    so the head is ready when a no-op job has succeeded, within 180 s, or the test fails with the
    agent's log."""
    dashboard = free_port()
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths live under it
    proc = subprocess.Popen(
        [
            "bash",
            os.path.join(REPO, "scripts", "start_head.sh"),
            "--block",
            "--port=0",
            f"--dashboard-port={dashboard}",
            "--dashboard-agent-listen-port=0",
            "--dashboard-agent-grpc-port=0",
            "--metrics-export-port=0",
            f"--temp-dir={temp_dir}",
        ],
        # what the script sets, it sets itself (not from the session's environment); the job drivers
        # inherit the rest (PYTHONPATH and the session's Ray token included)
        env={k: v for k, v in ENV.items() if k != "RAY_AUTH_MODE"},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_until_it_runs_a_job(address, temp_dir, timeout=180)
        yield Head(address, temp_dir, proc.pid)
    finally:
        kill_session(proc.pid)
        proc.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[Head]:
    """The module's head (`started_head`) for its jobs."""
    with started_head() as h:
        yield h


@pytest.fixture
def head(ray_head: Head) -> str:
    return ray_head.address


def wait_until_it_runs_a_job(address: str, temp_dir: str, timeout: float) -> None:
    deadline = time.time() + timeout
    job = None
    while job is None:
        try:
            job = JobSubmissionClient(address).submit_job(entrypoint="true")
        except (OSError, RuntimeError):  # the dashboard is not up yet, or its job agent not registered
            if time.time() > deadline:
                logs = glob.glob(os.path.join(temp_dir, "session_*", "logs", "dashboard_agent.log"))
                tail = Path(logs[0]).read_text()[-3000:] if logs else f"no dashboard_agent.log under {temp_dir}"
                pytest.fail(f"the head at {address} accepted no job in {timeout:.0f} s; its agent's log:\n{tail}")
            time.sleep(1)
    assert wait_for_end(address, job, timeout=max(deadline - time.time(), 30)) == JobStatus.SUCCEEDED


def ray_job(address: str, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    """`ray job ARGS --address ADDRESS`, as a user types it."""
    cmd = [os.path.join(BIN, "ray"), "job", args[0], "--address", address, *args[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)


def submit(address: str, submission_id: str, args: list[str], *flags: str) -> subprocess.CompletedProcess:
    """`ray job submit --submission-id ID [FLAGS] -- python jobs/pretrain.py --config tiny.yaml ARGS`."""
    entrypoint = ["--", "python", PRETRAIN, "--config", TINY, *args]
    return ray_job(address, "submit", "--submission-id", submission_id, *flags, *entrypoint)


def wait_for_commit(address: str, submission_id: str, snapshot, step: int) -> None:
    """Until Ray Train registered the checkpoint of `step` (its `checkpoint_manager_snapshot.json`);
    fails at once if the job ends first."""
    client = JobSubmissionClient(address)
    deadline = time.time() + 240
    while not (snapshot.exists() and step in committed_steps(snapshot)):
        status = client.get_job_status(submission_id)
        assert not status.is_terminal(), f"job {submission_id} {status}: {client.get_job_logs(submission_id)[-3000:]}"
        assert time.time() < deadline, f"step {step} not committed in 240 s"
        time.sleep(0.5)


def wait_for_end(address: str, submission_id: str, timeout: float = 120) -> JobStatus:
    client = JobSubmissionClient(address)
    deadline = time.time() + timeout
    while not (status := client.get_job_status(submission_id)).is_terminal() and time.time() < deadline:
        time.sleep(0.5)
    return status


def committed_steps(snapshot) -> list[int]:
    """Steps of the checkpoints Ray Train registered (its `checkpoint_manager_snapshot.json`)."""
    return sorted({int(s) for s in re.findall(r'"step-(\d+)"', snapshot.read_text())})


def assert_resubmission_succeeded(r: subprocess.CompletedProcess, tmp_path, name: str, last_step: int) -> None:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"run {name} finished" in r.stdout and "succeeded" in r.stdout
    assert os.path.exists(tmp_path / "runs" / name / f"step-{last_step}" / ".metadata")


def driver_pid(storage_path: str) -> int:
    """The pid of the job driver whose arguments include `run.storage_path=STORAGE_PATH` (not the
    shell Ray may run it under: there the whole command is one argument)."""
    wanted = f"run.storage_path={storage_path}"
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
        except OSError:
            continue
        if PRETRAIN in argv and wanted in argv:
            found.append(int(pid))
    assert len(found) == 1, found
    return found[0]


def wait_for_no_train_controller(address: str) -> None:
    """Until Ray has ended the job's Train controller (the writer of Ray's checkpoint snapshot), so
    that the snapshot's registrations are final."""
    from ray.util.state import list_actors

    deadline = time.time() + 60
    while list_actors(address=address, filters=[("class_name", "=", "TrainController"), ("state", "=", "ALIVE")]):
        assert time.time() < deadline, "the ended job's TrainController is still alive after 60 s"
        time.sleep(0.5)


@pytest.mark.exclusive
def test_a_stopped_job_and_a_killed_driver_are_resubmitted_into_one_finished_run(tmp_path, dataset, head):
    """One run, three submissions of the same `ray job submit`, on a cluster that stays up:
    1. `ray job stop` (SIGTERM to the driver, SIGKILL after `RAY_JOB_STOP_WAIT_TIME_S`) once step 10 was
       committed: the driver ends its MLflow run as KILLED and says so in its last line;
    2. the resubmission resumes, with the memory tier on from here, and once a memory copy newer than
       its next durable commit is in place its driver alone is SIGKILLed: nothing in the driver can
       clean up or record anything, and Ray ends the driver's actors (the Train controller, the
       workers, the tracking actor and the values it held), not the copies' keepers;
    3. resubmitted on a new cluster (another head; the first one, its keepers and their copies still
       up): it resumes from the last checkpoint Ray had registered, not from the newer copies of the
       first cluster's node (another cluster's copies are never read: docs/memory-tier.md), into the
       same MLflow run, and finishes it;
    4. a submission of another model into the finished run's folder is refused in one line."""
    name, steps = "resub", 30
    args = run_args(tmp_path, dataset, f"run.name={name}", f"train.max_steps={steps}", "checkpoint.interval_steps=5")
    # faults may change between submissions: steps of 1 s after step 10 where a stop or a kill must land
    # mid-run, none for the last submission
    slow = f"faults=[{{kind: slow, step: 11, steps: {steps - 10}, seconds: 1.0, rank: -1}}]"
    tier = ["checkpoint.memory.interval_steps=3", f"checkpoint.memory.dir={tmp_path / 'shm'}"]
    snapshot = tmp_path / "runs" / name / "checkpoint_manager_snapshot.json"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")

    def the_run():
        [one] = client.search_runs([client.get_experiment_by_name("raytrain-ft").experiment_id])
        return one

    # 1. stopped
    r = submit(head, "resub-1", [*args, slow], "--no-wait")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wait_for_commit(head, "resub-1", snapshot, 10)
    r = ray_job(head, "stop", "resub-1")  # waits until the job has ended
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert wait_for_end(head, "resub-1") == JobStatus.STOPPED
    # the driver's handler ended it within Ray's grace period (no SIGKILL cut it short); Ray keeps no exit
    # status for a stopped job, so the last line is the evidence the driver got to `sys.exit(143)`
    logs = ray_job(head, "logs", "resub-1").stdout
    assert logs.strip().splitlines()[-1].startswith(f"run {name} stopped by SIGTERM; its MLflow run is KILLED"), logs[
        -3000:
    ]
    wait_for_no_train_controller(head)
    stopped_at = max(committed_steps(snapshot))
    # the stop ended the training within seconds (a driver that only exits once `fit()` returns lets the
    # workers train to step 30)
    assert 10 <= stopped_at < steps - 5, f"training went on to step {stopped_at} after the stop"
    stopped = the_run()
    assert stopped.info.status == "KILLED" and stopped.info.end_time is not None

    # 2. resubmitted, its driver SIGKILLed after its first commit
    r = submit(head, "resub-2", [*args, slow, *tier], "--no-wait")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    wait_for_commit(head, "resub-2", snapshot, stopped_at + 5)
    newer = lambda: [s for s in copy_steps(tmp_path / "shm") if s > max(committed_steps(snapshot))]  # noqa: E731
    deadline = time.time() + 120
    while not newer():
        assert time.time() < deadline, "no memory copy newer than the durable checkpoint within 120 s"
        time.sleep(0.2)
    os.kill(driver_pid(str(tmp_path / "runs")), signal.SIGKILL)
    assert wait_for_end(head, "resub-2") == JobStatus.FAILED
    wait_for_no_train_controller(head)
    killed_at = max(committed_steps(snapshot))
    assert stopped_at < killed_at < steps
    assert max(copy_steps(tmp_path / "shm")) > killed_at  # left on the first cluster's node, its keeper up
    assert the_run().info.status == "RUNNING"  # the resubmission reopened it, and nobody was left to end it

    # 3. resubmitted on a new cluster: finished
    with started_head() as other:
        r = submit(other.address, "resub-3", [*args, "faults=[]", *tier])
    assert_resubmission_succeeded(r, tmp_path, name, steps)
    finished = the_run()
    assert finished.info.run_id == stopped.info.run_id and finished.info.status == "FINISHED"
    # Ray's snapshot is the record of what committed: each resubmission resumed from its last registration
    # (the killed tracking actor's values died with it, so `assert_resumed` has no MLflow evidence for it)
    attempts = events(f"sqlite:///{tmp_path / 'mlflow.db'}", finished.info.run_id, "attempt_start")
    assert [a["resumed_from"] for a in attempts] == [0, stopped_at, killed_at]
    assert [a["restored_from"] for a in attempts] == ["", "storage", "storage"]
    # one value per step of the stopped attempt, its unpublished ones included (recovered from
    # train_live/loss), and of the last one
    logged = {m.step for m in client.get_metric_history(finished.info.run_id, "train/loss")}
    assert set(range(1, stopped_at + 1)) | set(range(killed_at + 1, steps + 1)) <= logged

    # 4. a submission with another model into this run folder: refused in one line, before Ray starts
    r = pretrain(*args, "model.preset=small")
    assert r.returncode == 2
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"error: checkpoint {tmp_path / 'runs' / name}/step-{steps} belongs to a different"), line
    assert "model.preset: checkpoint tiny vs config small" in line
    assert os.path.exists(tmp_path / "runs" / name / f"step-{steps}" / ".metadata")  # nothing was deleted
    assert the_run().info.status == "FINISHED"  # nor reopened


def listening(session: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in a process of `session` (the head's processes
    and those they started; read from /proc, IPv4 and IPv6)."""
    inodes = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getsid(int(pid)) != session:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:[") : -1])
        except OSError:  # gone, or not ours to read
            continue
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = b"".join(int(hex_ip[i : i + 8], 16).to_bytes(4, "little") for i in range(0, len(hex_ip), 8))
            found.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return found


def test_every_process_of_the_demo_head_listens_on_loopback_only(ray_head):
    sockets = listening(ray_head.session)
    gcs_port = int(next(Path(ray_head.temp_dir, "session_latest").glob("gcs_server_port_*")).read_text())
    dashboard_port = int(ray_head.address.rsplit(":", 1)[1])
    assert {gcs_port, dashboard_port} <= {port for _, port in sockets}  # the reading sees the head's ports
    # a loopback address, IPv4 or IPv4-mapped IPv6 (not 0.0.0.0 / :: or the machine's network address)
    beyond = [(a, p) for a, p in sockets if not ipaddress.ip_address(a.removeprefix("::ffff:")).is_loopback]
    assert beyond == [], f"listening beyond loopback: {beyond}"


def refused_driver(gcs: str, env: dict[str, str], tmp_path: Path) -> str:
    """Connect a driver to `gcs` with `env` (plus Ray's single-machine mode, which a driver joining the
    demo's head needs: its node's address is 127.0.0.1); return the first line of its output naming the
    refused token. Ray retries the GCS for about 20 s before giving up: the driver is stopped at that
    line, or after 60 s (the test fails)."""
    code = f"import ray; ray.init(address={gcs!r}); print('connected', flush=True)"
    log = tmp_path / f"driver-{len(list(tmp_path.iterdir()))}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = log.read_text().splitlines()
            assert "connected" not in lines, "a driver without the head's token connected"
            refused = [line for line in lines if "InvalidAuthToken" in line]
            if refused:
                return refused[0]
            if proc.poll() is not None:
                pytest.fail(f"the driver ended without an authentication error: {lines[-5:]}")
            time.sleep(0.2)
        pytest.fail("the driver neither connected nor was refused in 60 s")
    finally:
        proc.kill()
        proc.wait()


def test_the_demo_head_refuses_job_and_driver_clients_without_its_token(ray_head, tmp_path):
    token = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    jobs = f"{ray_head.address}/api/jobs/"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(jobs, timeout=30)
    assert refused.value.code == 401
    with urllib.request.urlopen(urllib.request.Request(jobs, headers={"Authorization": f"Bearer {token}"})) as r:
        assert r.status == 200
    gcs = "127.0.0.1:" + next(Path(ray_head.temp_dir, "session_latest").glob("gcs_server_port_*")).read_text()
    without = {k: v for k, v in ENV.items() if k not in ("RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    for env in ({**without, "RAY_AUTH_MODE": "disabled"}, {**without, "RAY_AUTH_TOKEN": "0" * 64}):
        assert "Authentication token is missing or incorrect" in refused_driver(gcs, env, tmp_path)
