"""User-facing errors: each one is a single line saying what is wrong and how to fix it.

Entry points (`jobs/*.py`, the `raytrain-ft` CLI) catch `UserError`, print its message on one
line and exit with status 2; no traceback from deep inside Ray reaches the user. An error that a
restart cannot cure (`StorageFullError`) ends the run from the workers (`end_run`); the driver
raises it (`raise_if_ended`).
"""

from __future__ import annotations

import fsspec


class UserError(Exception):
    """A problem the user can fix (bad config, missing data, incompatible checkpoint)."""


class ConfigError(UserError):
    """An unknown config key, a value of the wrong type, or an inconsistent setting."""


class DataError(UserError):
    """A dataset that is missing, empty or unreadable."""


class CheckpointError(UserError):
    """No loadable checkpoint is left, or a checkpoint belongs to another model or dataset."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint that cannot be used as stored: bytes that fail their checksums, a missing file or
    checksum record, or a component of the train state missing. The restore falls back to an older
    checkpoint (`raytrain_ft.checkpoint.Checkpointer.restore`); the message names the checkpoint and the item."""


class StorageFullError(CheckpointError):
    """A checkpoint does not fit on `run.storage_path`: a restart cannot cure it, so the run ends."""


def find_user_error(exc: BaseException) -> UserError | None:
    """Return the first `UserError` in `exc`'s cause/context chain (Ray wraps worker errors)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UserError):
            return e
        for attr in ("cause", "__cause__", "__context__"):
            nxt = getattr(e, attr, None)
            if isinstance(nxt, BaseException):
                stack.append(nxt)
        for nxt in getattr(e, "worker_failures", {}).values() if hasattr(e, "worker_failures") else ():
            stack.append(nxt)
    return None


RUN_ENDED_FILE = "run_ended_by_error"


def end_run(run_root: str, message: str) -> None:
    """Stop training without a restart (rank 0, the others just return): leave `message` in
    `<run folder>/run_ended_by_error` for the driver, which reports it as the run's error (`raise_if_ended`)."""
    with fsspec.open(f"{run_root.rstrip('/')}/{RUN_ENDED_FILE}", "w") as f:
        f.write(message)


def raise_if_ended(run_root: str) -> None:
    """Driver, after the workers returned: raise the error a worker ended the run with, if any
    (and remove its file, so a resubmission starts clean).

    Raises:
        StorageFullError: the message `end_run` left.
    """
    fs, base = fsspec.core.url_to_fs(f"{run_root.rstrip('/')}/{RUN_ENDED_FILE}")
    if fs.exists(base):
        message = fs.cat_file(base).decode()
        fs.rm(base)
        raise StorageFullError(message)
