"""Ray-free runs for the loop-level tests: `world_size` gloo ranks in spawned processes, each running
`raytrain_ft.training.loop.train` on a `LocalSession`.

An attempt that fails (a rank raised, or a rank's process died) is followed by a new attempt of fresh
processes, as Ray Train's group restart does, up to `failure.max_failures` restarts; the new attempt
resumes from `<run folder>/latest_checkpoint`. What Ray adds and these runs lack: the driver's
`failure` events and `restarts` metric (the controller callback records them), preemption notices,
Ray Data reads (LocalSession reads the same rows with pyarrow), and elastic resizes (the test picks
each attempt's world size). Tests that assert those run through `raytrain_ft.launch.driver.run`.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from raytrain_ft.core.config import Config
from raytrain_ft.core.config_files import from_dict, to_dict
from raytrain_ft.core.run_folder import run_root
from raytrain_ft.telemetry.tracking import MlflowRecorder, finish_run, flatten, start_or_resume_run
from raytrain_ft.training.local_session import LocalSession
from raytrain_ft.training.loop import train

# Ranks fork from one server process that imported these once (`multiprocessing` "forkserver"): a
# rank that imports them itself spends ~5 s of CPU per rank and attempt (a 30-step run took 8-9 s, 2.6 s
# preloaded). Package modules only: the server is a fresh `python -c` in the current folder, and
# CPython 3.11's `forkserver.main` does not apply the parent's `sys.path`, so a module of tests/ (this
# one, preloaded here before) fails to import there and the preload is skipped without a word
# (tests/test_local_run.py imports every name the way the server does). MLflow's SQL store is imported
# at the first client of a `sqlite:` URI, not by `import mlflow`; the loss plot imports matplotlib.
PRELOAD = [
    "raytrain_ft.training.local_session",
    "raytrain_ft.training.loop",
    "raytrain_ft.telemetry.tracking",
    "raytrain_ft.telemetry.plots",
    "mlflow.store.tracking.sqlalchemy_store",
]
multiprocessing.set_forkserver_preload(PRELOAD)


# after a rank failed, the others' own ending (their collective fails at once: the peer is gone) may
# take this long before they are terminated: it drains their recorders (`_rank`), as Ray's recorder
# actor outlives a worker group
FAILED_RANK_GRACE_S = 30.0


class LocalRunFailed(RuntimeError):
    """Every attempt of a local run failed."""


def _rank(rank: int, config: dict, run_id: str, world_size: int, store: str) -> None:
    torch.set_num_threads(1)  # as in a Ray Train worker of a fractional CPU (OMP_NUM_THREADS=1)
    cfg = from_dict(config)
    # the bound Ray Train gives the group (`TorchConfig(timeout_s=...)`, raytrain_ft.launch.driver)
    timeout = timedelta(seconds=cfg.failure.collective_timeout_s)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timeout)
    root = run_root(cfg.run.storage_path, cfg.run.name)
    session = LocalSession(root, cfg.data.path, cfg.train.seed, cfg.tracking.uri, run_id, cfg.waits.tracking_timeout_s)
    try:
        train(cfg, session)
    finally:  # a failed rank's too: what the store did not take yet (it was away, or slow) is sent before the exit
        session.run_recorder.drain(120.0)
        dist.destroy_process_group()


def rank_errors(error_files: list[str]) -> str:
    """The last line of every rank's error that torch's `start_processes` wrote (those that raised), by
    rank: the first rank `join` found dead is often one whose collective failed because a peer raised,
    so the cause is in another rank's line."""
    lines = []
    for rank, path in enumerate(error_files):
        if os.access(path, os.R_OK):
            with open(path, "rb") as f:
                trace = pickle.load(f).strip()
            lines.append(f"rank {rank}: {trace.splitlines()[-1] if trace else '?'}")
    return "; ".join(lines)


def local_run(cfg: Config, world_size: int | None = None) -> str:
    """Run `cfg` to the end without Ray at `world_size` ranks (default: the config's); return the
    MLflow run id. The run ends FINISHED or FAILED as a driver's does (`tracking.finish_run`).

    Raises:
        LocalRunFailed: once `failure.max_failures` restarts are used up.
        StorageFullError: a worker ended the run (a full disk), as from `raytrain_ft.launch.driver.run`.
    """
    root = run_root(cfg.run.storage_path, cfg.run.name)
    os.makedirs(root, exist_ok=True)
    uri = cfg.tracking.uri
    run_id = start_or_resume_run(uri, cfg.tracking.experiment, root, cfg.run.name, flatten(to_dict(cfg)))
    n = world_size or cfg.worker_range[1]
    errors = []
    for _ in range(cfg.failure.max_failures + 1):
        store = os.path.join(tempfile.mkdtemp(prefix="pg-"), "store")
        try:
            ranks = mp.start_processes(
                _rank, args=(to_dict(cfg), run_id, n, store), nprocs=n, join=False, start_method="forkserver"
            )
            while not ranks.join(grace_period=FAILED_RANK_GRACE_S):
                pass
        except ProcessException as e:  # a rank raised or died: the others ended or were terminated
            errors.append(rank_errors(ranks.error_files) or repr(e))
            continue
        finish_run(MlflowRecorder(uri, run_id), root, failed=False)  # the driver's owner of the end status
        return run_id
    finish_run(MlflowRecorder(uri, run_id), root, failed=True)
    raise LocalRunFailed(f"run {cfg.run.name} failed {len(errors)} times: {errors}")
