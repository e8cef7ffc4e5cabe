"""A run's end status (`tracking.finish_run`), the one owner the Ray driver and the Ray-free runner
(`tests/local_run.py`) both end their runs through, on a real SQLite MLflow store."""

from __future__ import annotations

import os

import pytest
from mlflow.tracking import MlflowClient

from conftest import sqlite_store
from raytrain_ft.core.errors import StorageFullError
from raytrain_ft.core.run_folder import RUN_ENDED_FILE, end_run
from raytrain_ft.telemetry.tracking import MlflowRecorder, finish_run, start_or_resume_run

FULL = "checkpoint step-15 does not fit on /x: about 2 bytes needed, 1 free"


def test_the_end_status_is_failed_after_a_failed_attempt_or_a_worker_ending_the_run(tmp_path):
    uri = sqlite_store(tmp_path)
    statuses = {}
    for name in ("finished", "failed", "ended"):
        root = str(tmp_path / name)
        run_id = start_or_resume_run(uri, "e", root, name, {})
        if name == "ended":  # rank 0 on a full disk (`loop.train`): the workers return normally
            end_run(root, FULL)
            with pytest.raises(StorageFullError, match="^checkpoint step-15 does not fit on /x"):
                finish_run(MlflowRecorder(uri, run_id), root, failed=False)
            assert not os.path.exists(os.path.join(root, RUN_ENDED_FILE))  # a resubmission starts clean
        else:
            finish_run(MlflowRecorder(uri, run_id), root, failed=name == "failed")
        info = MlflowClient(uri).get_run(run_id).info
        statuses[name] = info.status
        assert info.end_time is not None
    assert statuses == {"finished": "FINISHED", "failed": "FAILED", "ended": "FAILED"}
