"""`raytrain-ft check`: the driver's preflight as a command, on every shipped config and on bad input."""

from __future__ import annotations

import glob
import os
import sysconfig

import pytest

from conftest import REPO
from raytrain_ft.cli import main
from raytrain_ft.core.config_files import load_config
from raytrain_ft.data.prepare import PrepareSettings
from raytrain_ft.launch.prepare import prepare

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


@pytest.fixture(scope="session")
def corpus_2048(tmp_path_factory, ray_local) -> str:
    """A real corpus at the GPU configs' seq_len 2048, large enough for their global batch of 1024
    sequences in 1024 lanes (gpu-70b's micro_batch_size 1): >= 2047 samples in row groups of 1."""
    out = str(tmp_path_factory.mktemp("data") / "seq2048")
    stdlib = sysconfig.get_paths()["stdlib"]
    # the top folder of CPython's own test suite (13 MB of .py, ~2,900 samples) where the interpreter
    # ships it: a third of the preparing time of the whole standard library, which stays the fallback
    tests = os.path.join(stdlib, "test")
    pattern = os.path.join(tests, "test_*.py") if os.path.isdir(tests) else os.path.join(stdlib, "**", "*.py")
    prepare(pattern, out, PrepareSettings(seq_len=2048, vocab_size=512, rows_per_row_group=1))
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_passes_check(path, tmp_path, dataset, corpus_2048, capsys):
    """As shipped, with data, storage and tracking pointed at local test data and folders."""
    data = corpus_2048 if load_config(path).train.seq_len == 2048 else dataset
    local = [f"data.path={data}", f"run.storage_path={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    assert main(["check", "--config", path, *local]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"ok: {path}: world sizes")


def check_lines(capsys, *argv: str) -> tuple[int, list[str]]:
    """`raytrain-ft check` as the console script runs it (`cli.main`, in this process: a new
    interpreter importing torch cost ~5 s a call): exit status and its stderr lines."""
    rc = main(["check", *argv])
    return rc, capsys.readouterr().err.strip().splitlines()


def test_check_fails_in_one_line_per_problem(tmp_path, dataset, capsys):
    tiny = os.path.join(REPO, "configs", "tiny.yaml")
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the storage folder should be: not writable as a folder
    rc, lines = check_lines(
        capsys,
        "--config",
        tiny,
        f"data.path={dataset}",
        "train.global_batch_size=2",
        "train.micro_batch_size=1",
        "scaling.num_workers=3",
        "train.seq_len=64",
        f"run.storage_path={blocked}/runs",
        "tracking.uri=http://127.0.0.1:9",
    )
    assert rc == 2
    assert lines[0] == (
        "error: train.global_batch_size=2 is smaller than the world size 3: every rank needs at least one "
        "sequence per step; raise global_batch_size to at least 3 or lower scaling.num_workers"
    )
    assert lines[1] == "error: train.seq_len=64 but the dataset has seq_len 32"
    assert lines[2].startswith("error: tracking.uri=http://127.0.0.1:9 does not answer (")
    assert lines[2].endswith("); start the MLflow server or fix tracking.uri")
    assert lines[3].startswith(f"error: run.storage_path={blocked}/runs is not writable (")
    assert len(lines) == 4 and not any("Traceback" in line for line in lines)


def test_check_ignores_the_job_submission_address(tmp_path, dataset, capsys, monkeypatch):
    """`export RAY_ADDRESS=http://127.0.0.1:8265` (the docs' cluster workflow) is the dashboard's
    address for `ray job`, not one `ray.init` can join: check runs without the resources check."""
    tiny = os.path.join(REPO, "configs", "tiny.yaml")
    local = [f"data.path={dataset}", f"run.storage_path={tmp_path}/runs", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    assert main(["check", "--config", tiny, *local]) == 0, capsys.readouterr().err
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith("cluster resources not checked (no Ray cluster address: --address or RAY_ADDRESS)")
    )
