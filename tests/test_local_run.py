"""`tests/local_run.py`'s forkserver preload: what the Ray-free tests' speed rests on."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO
from local_run import PRELOAD


def test_the_forkserver_can_import_every_preloaded_module():
    """The forkserver imports `PRELOAD` in a fresh interpreter in the current folder, with none of the
    parent's `sys.path` (a failed import there is skipped silently, and every rank then imports
    torch, transformers and MLflow itself): the same here, where each name must import."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)"
    r = subprocess.run([sys.executable, "-c", code, *PRELOAD], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
