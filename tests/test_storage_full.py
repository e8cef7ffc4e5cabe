"""A run whose checkpoints outgrow `run.storage_path` (a real 6 MB tmpfs) ends at once, in one line."""

from __future__ import annotations

import os
import subprocess

import pytest
from mlflow.tracking import MlflowClient

from conftest import make_config, step_dirs
from raytrain_ft.core.errors import StorageFullError
from raytrain_ft.core.run_folder import RUN_ID_FILE
from raytrain_ft.launch.driver import run
from raytrain_ft.telemetry.tracking import MlflowRecorder

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MB tmpfs: two 2.2 MB tiny checkpoints fit, a third does not.

    A real filesystem that fills up (ENOSPC from the kernel, `statvfs` free space for the pre-save
    check) is the only faithful full disk: a mocked filesystem would not exercise DCP's writer or
    `shutil.disk_usage`. Mounting needs root (or CAP_SYS_ADMIN), as CI and the dev machines run;
    where the mount is denied the test fails and says so, instead of skipping out of sight.
    """
    mount = tmp_path / "small"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True, text=True)
    if r.returncode:
        pytest.fail(f"cannot mount a 6 MB tmpfs (needs root or CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_ends_the_run_in_one_line_without_spending_restarts(tmp_path, dataset, small_disk):
    cfg = make_config(tmp_path, dataset, "train.max_steps=20", f"run.storage_path={small_disk}")
    with pytest.raises(StorageFullError) as e:
        run(cfg)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint step-15 does not fit on {small_disk}/tiny: about ")
    needed, free = (int(x.split()[0]) for x in message.split(": about ")[1].split(", ")[:2])
    assert needed > 2_000_000 and free < needed
    assert message.endswith("free space there, lower checkpoint.num_to_keep, or move run.storage_path")
    # the committed checkpoints survive; no restart was spent on an error a restart cannot cure
    assert sorted(os.path.basename(d) for d in step_dirs(cfg)) == ["step-10", "step-5"]
    with open(os.path.join(small_disk, "tiny", RUN_ID_FILE)) as f:
        run_id = f.read().strip()
    assert not [ev for ev in MlflowRecorder(cfg.tracking.uri, run_id).events() if ev["kind"] == "failure"]
    assert MlflowClient(cfg.tracking.uri).get_run(run_id).info.status == "FAILED"
