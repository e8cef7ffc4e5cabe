"""Shared fixtures: a small real dataset, one real local Ray instance, config and MLflow helpers.

Two helpers every resume test uses (keep their names: other test files depend on them):
- `assert_resumed(uri, run_id, expected)`: the step each attempt resumed from, in order; a run that
  silently ignored its checkpoint ends with the same weights and data as one that resumed, so the
  step is what proves it resumed.
- `assert_same_state(a, b)` / `assert_tensors_equal(a, b)`: the one way to compare weights.
"""

from __future__ import annotations

import os
import secrets
import tempfile

# Every Ray of the tests runs with token authentication (docs/cluster.md#security): one token for
# every Ray instance and client of the session (this process's children inherit it), in a file of
# its own, so that the user's ~/.ray/auth_token is neither read nor written. Set before the first
# `import ray`: Ray reads RAY_AUTH_MODE once, when it is imported. (Loopback only is the demo head's,
# tests/test_jobs.py; Ray's single-machine mode made the multi-node `Cluster` runs 20 % slower.)
_RAY_TOKEN = os.path.join(tempfile.mkdtemp(prefix="ray-token-"), "auth_token")
with open(os.open(_RAY_TOKEN, os.O_WRONLY | os.O_CREAT, 0o600), "w") as _f:
    _f.write(secrets.token_hex(32))  # as Ray's `ray get-auth-token --generate` makes one
os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=_RAY_TOKEN)

import glob
import itertools
import json
import pickle
import shutil
import socket
import subprocess
import sys
import sysconfig
import threading
import time

import pytest
import ray
import torch
import torch.distributed as dist
from mlflow.tracking import MlflowClient

from raytrain_ft.checkpoint.reader import load_model_state_dict, load_tensors
from raytrain_ft.core.config import TrainSection
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.run_folder import step_path
from raytrain_ft.core.schedule import lr_schedule
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import EpochOrder, steps_per_epoch
from raytrain_ft.data.prepare import PrepareSettings
from raytrain_ft.launch.driver import job_runtime_env
from raytrain_ft.launch.prepare import prepare
from raytrain_ft.launch.ray_start import RAY_NODE_ENV
from raytrain_ft.telemetry.tracking import MlflowRecorder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
STDLIB_JSON = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Shape the two workers of `pytest -n 2 --dist loadgroup` (scripts/test.sh) on 2 cores.

    The `exclusive` tests (whose bounds or measurements assume the machine's cores: a whole run with
    failures, a minute or more, on a Ray cluster of its own or on `ray_local` with all its CPUs; a
    straggler detection from measured compute seconds) form one group, run one after another on one
    worker and first (never two at once); every other test file is one group of its own, so its
    module fixtures (shared runs) are made once. The other worker takes those files, in the idle
    scheduling class (`pytest_runtest_setup`). Without xdist the markers change nothing."""
    items.sort(key=lambda item: item.get_closest_marker("exclusive") is None)  # stable: files keep their order
    for item in items:
        group = "exclusive" if item.get_closest_marker("exclusive") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup`, fail the run if xdist ignored the groups (pytest-xdist 3.8 marks a
    test's group in `item._nodeid`, which pytest 9.2 no longer reads: pyproject.toml pins pytest
    below it). Ignored groups would run two Ray scenarios at once and every file's shared runs twice."""
    if session.config.getoption("loadgroup", default=False) and not all("@" in item.nodeid for item in session.items):
        raise pytest.UsageError(
            "pytest-xdist ignored the test groups: install the pinned pytest: pip install -e '.[dev]'"
        )


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures: the processes they start inherit it
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, a worker about to run a test that is not `exclusive` moves itself, once, to Linux's
    idle scheduling class (`SCHED_IDLE`: it runs only on a core nothing else wants): the exclusive
    tests' bounds assume the cores, so the other worker's tests, and the Ray processes they start
    (they inherit it), take only the CPU those leave. A niceness would not do: Ray runs its worker
    processes at nice 15 (`RAY_worker_niceness`), below a nice-10 pytest worker and barely above a
    nice-19 one. The worker of the exclusive group runs it first and only then other tests
    (`pytest_collection_modifyitems`), so no exclusive test runs idle-class."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and not item.get_closest_marker("exclusive") and os.sched_getscheduler(0) != os.SCHED_IDLE:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


@pytest.fixture(scope="session")
def dataset(tmp_path_factory, ray_local) -> str:
    """599 samples of 33 tokens from the stdlib `json` package, vocab 512, row groups of 2 samples.

    Small row groups let the 4-6 lanes of the tests' global batches (`raytrain_ft.data.order`) fill
    all but `num_samples % global_batch_size` samples of each epoch: 74 steps at global batch 8.
    No validation split: every document trains (tests/test_validation.py prepares one with a split)."""
    out = str(tmp_path_factory.mktemp("data") / "tiny")
    settings = PrepareSettings(
        seq_len=32, vocab_size=512, rows_per_row_group=2, validation_fraction=0.0, validation_min_docs=0
    )
    prepare(STDLIB_JSON, out, settings)
    return out


def run_scenario(script: str, *args: str, timeout_s: float = 900) -> dict:
    """Run `tests/scenarios/<script>` in its own process (a multi-node `ray.cluster_utils.Cluster`
    cannot share this process's Ray) and return the JSON object it prints as its outcome: its last
    line that is one (the raylet may print warnings to the driver's stdout after it, e.g. at shutdown).

    Raises:
        AssertionError: the script exited non-zero (the assertion shows its stderr's tail).
        subprocess.TimeoutExpired: it ran past `timeout_s` seconds.
    """
    r = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "scenarios", script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        # tests/ on the path: a scenario imports its siblings as `scenarios.<name>`, as the tests do
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")])),
        },
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(next(line for line in reversed(r.stdout.splitlines()) if line.startswith("{")))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick; nothing holds it now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the in-process training tests (3 logical CPUs on 2 cores).

    Its dashboard address is a port nothing serves, and its processes ask only that address for the
    state API (`RAY_API_SERVER_ADDRESS`). Ray Train 2.60's placement-group cleaner asks the state API
    every second whether the controller is alive, and removes the running worker group's placement
    group (every worker dies: a counted failure) when the answer is "no such actor". A cluster
    without a dashboard still advertises 127.0.0.1:8265, and a worker without `RAY_ADDRESS` finds
    "the" cluster by looking around the host: another cluster's dashboard there (`ray start --head`,
    a `ray.cluster_utils.Cluster` of a concurrent run) answered for this one and ended a healthy
    attempt of test_watchdog.py."""
    os.environ.update(RAY_NODE_ENV)
    port = free_port()
    # job_runtime_env: the MLflow credentials too, set in this process's environment for the tests'
    # clients and the scenarios' processes, as a job does (tests/test_recovery.py's tracking server)
    env = {**job_runtime_env()["env_vars"], "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{port}"}
    ray.init(
        address="local",
        num_cpus=3,
        include_dashboard=False,
        dashboard_port=port,
        runtime_env={"env_vars": env},
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo process group in this process (loop and checkpoint code without Ray)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


_EMPTY_STORE = os.path.join(tempfile.mkdtemp(prefix="mlflow-empty-"), "mlflow.db")


WAIT_S = 600  # any single wait of a fault-injecting test longer than this is a hung run, not a slow machine


class BackgroundRun(threading.Thread):
    """`entry(cfg)` (the driver's `run`, or `local_run`) in a daemon thread, started at once, so that a
    test can kill processes while the run trains. Keeps what the run returned (`run_id`) or the
    exception it raised (`error`), which `wait_for` and `finished` name when the run ended early."""

    def __init__(self, entry, cfg):
        super().__init__(daemon=True)
        self._entry, self._cfg = entry, cfg
        self.run_id: str | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.run_id = self._entry(self._cfg)
        except BaseException as e:  # kept for the test's message; the thread ends either way
            self.error = e

    def outcome(self) -> str:
        return f"{type(self.error).__name__}: {self.error}" if self.error else f"returned {self.run_id!r}"

    def finished(self, timeout_s: float = WAIT_S) -> str:
        """Join the run (at most `timeout_s`); its run id. Raises AssertionError if it is still running
        or it raised."""
        self.join(timeout=timeout_s)
        assert not self.is_alive(), f"the run did not end within {timeout_s:g} s"
        assert self.error is None and self.run_id, f"the run did not finish: {self.outcome()}"
        return self.run_id


def wait_for(what: str, condition, trainer: BackgroundRun):
    """Poll `condition()` every 50 ms until it returns a truthy value (returned); fail if the run's
    `trainer` ended first (saying how) or after `WAIT_S` seconds."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        assert trainer.is_alive(), f"the run ended while the test waited for {what}: {trainer.outcome()}"
        time.sleep(0.05)
    raise AssertionError(f"waited {WAIT_S} s for {what}")


def first_steps_alone(alone: set[int], start: int) -> set[int]:
    """The steps `start + 1`, `start + 2`, ... that are all in `alone` (steps one replica trained
    alone): under replica recovery an attempt's first steps, when one replica formed its first quorum
    before the other joined (it started later than the lighthouse's join window, as under load)."""
    return set(itertools.takewhile(alone.__contains__, itertools.count(start + 1)))


def copy_steps(memory_dir) -> list[int]:
    """Steps of the memory tier's committed copies under `memory_dir` (`checkpoint.memory.dir`), any
    node's, any rank's (read by the test, which sees the machine's files; a run reads another node's
    only through its keeper)."""
    return [
        int(os.path.basename(os.path.dirname(p)).split("-")[1])
        for p in glob.glob(f"{memory_dir}/*/*/rank-*/step-*/COMMITTED")
    ]


def sqlite_store(folder) -> str:
    """`sqlite:///<folder>/mlflow.db`, created as a copy of one empty store that MLflow made (its
    schema migrations cost ~2 s per new SQLite file: once per test session instead of once per run).
    An existing file is left as it is (a resubmission logs into the same store)."""
    path = os.path.join(str(folder), "mlflow.db")
    if not os.path.exists(_EMPTY_STORE):
        MlflowClient(f"sqlite:///{_EMPTY_STORE}").search_experiments()
    if not os.path.exists(path):
        os.makedirs(str(folder), exist_ok=True)
        shutil.copyfile(_EMPTY_STORE, path)
    return f"sqlite:///{path}"


def make_config(tmp_path, dataset: str, *overrides: str):
    """The tiny test config with its run, data and MLflow store (`sqlite_store`) inside `tmp_path`."""
    return load_config(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [
            f"data.path={dataset}",
            f"run.storage_path={tmp_path / 'runs'}",
            f"tracking.uri={sqlite_store(tmp_path)}",
            *overrides,
        ],
    )


def metric_by_step(cfg, run_id: str, key: str) -> dict[int, float]:
    """{step: value} of a metric; for a step logged twice (re-run after a restart) the later one."""
    history = MlflowClient(cfg.tracking.uri).get_metric_history(run_id, key)
    out = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        out[m.step] = m.value
    return out


def step_dirs(cfg) -> list[str]:
    return sorted(glob.glob(os.path.join(cfg.run.storage_path, cfg.run.name, "step-*")))


def run_root(cfg) -> str:
    return os.path.join(cfg.run.storage_path, cfg.run.name)


def checkpoint_state(path: str) -> dict[str, torch.Tensor]:
    """Model weights and optimizer tensors (keys `optim.*`) of a checkpoint folder (local or fsspec URL)."""
    return {**load_model_state_dict(path), **{f"optim.{k}": v for k, v in load_tensors(path, "optim").items()}}


def stored_item(path: str, fqn: str):
    """(file, offset, length) of the item `fqn` of checkpoint `path`, from its DCP metadata."""
    with open(f"{path}/.metadata", "rb") as f:
        meta = pickle.load(f)
    [info] = [s for index, s in meta.storage_data.items() if index.fqn == fqn]
    return info.relative_path, info.offset, info.length


def flip_bit(path: str, fqn: str) -> None:
    """Flip one bit in the middle of item `fqn` (or of the file `.metadata`) of checkpoint `path`."""
    if fqn == ".metadata":
        name, offset, length = ".metadata", 0, os.path.getsize(f"{path}/.metadata")
    else:
        name, offset, length = stored_item(path, fqn)
    with open(f"{path}/{name}", "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)[0]
        f.seek(offset + length // 2)
        f.write(bytes([byte ^ 0x10]))


def final_state(cfg, step: int) -> dict[str, torch.Tensor]:
    return checkpoint_state(step_path(run_root(cfg), step))


COMMITTED = "committed"  # an expected resume step that depends on timing: any step > 0 the run committed


def events(uri: str, run_id: str, kind: str) -> list[dict]:
    """The run's events of one kind, oldest first."""
    return [e for e in MlflowRecorder(uri, run_id).events() if e["kind"] == kind]


def assert_resumed(uri: str, run_id: str, expected: list) -> list[dict]:
    """Assert where each attempt of the run started, in order, and return the attempts.

    `expected[i]` is the exact step attempt i resumed from (0: a fresh start) where it is
    deterministic (injected faults settle first, so they are), or `COMMITTED` where it depends on
    timing: then the step must be > 0. Either way a step > 0 must have been committed before the
    attempt started: the goodput metrics are logged at that step by its commit (or by an earlier
    attempt that resumed from it), with an earlier timestamp. Attempts are the `attempt_start`
    events (fields `resumed_from`, `world_size`, `time`).
    """
    attempts = events(uri, run_id, "attempt_start")
    got = [a["resumed_from"] for a in attempts]
    assert len(got) == len(expected), f"attempts resumed from {got}, expected {expected}"
    logged = MlflowClient(uri).get_metric_history(run_id, "wall_s")
    for a, want in zip(attempts, expected, strict=True):
        step = a["resumed_from"]
        assert step > 0 if want == COMMITTED else step == want, f"attempts resumed from {got}, expected {expected}"
        if step > 0:
            committed = {m.step for m in logged if m.timestamp / 1000 < a["time"]}
            assert step in committed, f"an attempt resumed from step {step}, which was never committed before it"
    return attempts


STEP_METRICS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "epoch", "checkpoint_stall_s")


def assert_kept_timeline(
    cfg, run_id: str, ref_cfg, ref_run: str, discarded: list[int], rerun_kept: tuple[int, ...] = ()
) -> None:
    """One value per step on the kept timeline, equal to the uninterrupted run's where training is
    deterministic; the re-run steps' first values under `train_discarded/`, every value under `train_live/`
    (`rerun_kept`: steps that ran twice and kept their first value, after a corrupt-checkpoint fallback)."""
    client, steps = MlflowClient(cfg.tracking.uri), list(range(1, cfg.train.max_steps + 1))
    for key in STEP_METRICS:
        assert sorted(m.step for m in client.get_metric_history(run_id, f"train/{key}")) == steps, key
        assert sorted(m.step for m in client.get_metric_history(run_id, f"train_discarded/{key}")) == discarded, key
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/epoch"):
        assert metric_by_step(cfg, run_id, key) == metric_by_step(ref_cfg, ref_run, key), key
    live = sorted(steps + discarded + list(rerun_kept))
    assert sorted(m.step for m in client.get_metric_history(run_id, "train_live/loss")) == live


def expected_step_ids(dataset: str, steps: int, global_batch_size: int) -> dict[int, list[int]]:
    """What exactly-once means, computed from the order alone: {step: sorted sample ids} of steps
    1..`steps`, step s of an epoch taking global batch s of that epoch's permutation (seed 0,
    micro-batch 2), whatever the world size."""
    m = load_manifest(dataset)
    per_epoch = steps_per_epoch(m, global_batch_size, micro_batch_size=2)
    out = {}
    for epoch in range((steps - 1) // per_epoch + 1):
        order = EpochOrder(dataset, m, 0, epoch, global_batch_size, micro_batch_size=2)
        for i, ids in enumerate(order.step_sample_ids(0, per_epoch)):
            out[epoch * per_epoch + i + 1] = sorted(ids.tolist())
    return {s: out[s] for s in range(1, steps + 1)}


def uninterrupted_lrs(train: TrainSection) -> dict[int, float]:
    """{step: lr logged after that step} of an uninterrupted run: the schedule alone decides it."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=train.lr)
    schedule = lr_schedule(optimizer, train)
    lrs = {}
    for step in range(1, train.max_steps + 1):
        optimizer.step()
        schedule.step()
        lrs[step] = schedule.get_last_lr()[0]
    return lrs


def assert_tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bitwise equality of two non-empty tensor dicts with the same key set (an empty or partial
    dict never passes, unlike `all(torch.equal(a[k], b[k]) for k in a)`)."""
    assert a, "no tensors to compare"
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two `final_state`s: model AND optimizer tensors present and bitwise equal."""
    assert any(k.startswith("optim.") for k in a), "no optimizer state"
    assert any(not k.startswith("optim.") for k in a), "no model weights"
    assert_tensors_equal(a, b)


# Every guard at a short interval, `on_alert: restart` (test_guards.py): guards never change what a run
# computes, so the reference run carries them too and doubles as the guards' clean run. The fingerprint's
# interval (7) does not divide the checkpoint interval (5): some flips are caught only by the check
# before a save, others by the interval check.
GUARDED = ["guards.fingerprint.interval_steps=7", "guards.rank_check.interval_steps=1", "guards.on_alert=restart"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory, dataset):
    """The uninterrupted 30-step run every resume test compares against (with the `GUARDED` settings).

    Ray-free (`local_run`): the Ray runs that end bitwise equal to it (test_recovery, test_chaos,
    test_group_start, test_remote_storage) are what pin that a Ray Train run and the Ray-free session
    train the same bits on the same sequences."""
    from local_run import local_run

    cfg = make_config(
        tmp_path_factory.mktemp("reference"), dataset, "run.name=ref", "train.max_steps=30", "data.audit=true", *GUARDED
    )
    run_id = local_run(cfg)
    return cfg, run_id, final_state(cfg, 30)


FSDP = ["parallel.strategy=fsdp", "train.global_batch_size=12", "train.max_steps=30", "data.audit=true"]
NAN_AT_8 = "{kind: nan, step: 8, rank: 1}"


@pytest.fixture(scope="session")
def fsdp_ref(tmp_path_factory, dataset):
    """Uninterrupted 30-step FSDP run at 2 ranks, dropout 0.1, a NaN loss on rank 1 at step 8 (the
    FSDP resume, guard and cross-load tests in test_sharding.py compare against it; test_export.py
    exports it). Ray-free (`local_run`): its readers need only its files and the MLflow params and
    tags the loop writes."""
    from local_run import local_run

    cfg = make_config(tmp_path_factory.mktemp("fsdp_ref"), dataset, "run.name=fsdp", *FSDP, f"faults=[{NAN_AT_8}]")
    run_id = local_run(cfg)
    return cfg, run_id, final_state(cfg, 30)
