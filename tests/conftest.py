"""Shared fixtures: a small real dataset, one real local Ray instance, config and MLflow helpers."""

from __future__ import annotations

import glob
import os
import sysconfig

import pytest
import ray
import torch
import torch.distributed as dist
from mlflow.tracking import MlflowClient

from raytrain_ft.checkpoint import load_model_state_dict, load_tensors, step_path
from raytrain_ft.config import load_config
from raytrain_ft.data.prepare import PrepareSettings, prepare
from raytrain_ft.launch.trainer import WORKER_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIB_JSON = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> str:
    """~600 samples of 33 tokens from the stdlib `json` package, vocab 512."""
    out = str(tmp_path_factory.mktemp("data") / "tiny")
    prepare(STDLIB_JSON, out, PrepareSettings(seq_len=32, vocab_size=512))
    return out


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the in-process training tests (3 logical CPUs on 2 cores)."""
    ray.init(
        address="local", num_cpus=3, include_dashboard=False, runtime_env={"env_vars": WORKER_ENV}, log_to_driver=False
    )
    yield
    ray.shutdown()


@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo process group in this process (loop and checkpoint code without Ray)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def make_config(tmp_path, dataset: str, *overrides: str):
    """The tiny test config with its run, data and MLflow store inside `tmp_path`."""
    return load_config(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [
            f"data.path={dataset}",
            f"run.storage_path={tmp_path / 'runs'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
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


def final_state(cfg, step: int) -> dict[str, torch.Tensor]:
    path = step_path(run_root(cfg), step)
    return {**load_model_state_dict(path), **{f"optim.{k}": v for k, v in load_tensors(path, "optim").items()}}


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


@pytest.fixture(scope="session")
def reference(tmp_path_factory, dataset, ray_local):
    """The uninterrupted 30-step run every resume test compares against."""
    tmp = tmp_path_factory.mktemp("reference")
    from raytrain_ft.launch.trainer import run

    cfg = make_config(tmp, dataset, "run.name=ref", "train.max_steps=30", "data.audit=true")
    run_id = run(cfg)
    return cfg, run_id, final_state(cfg, 30)
