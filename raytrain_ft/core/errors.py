"""User-facing errors: each one is a single line saying what is wrong and how to fix it.

Entry points (`jobs/*.py`, the `raytrain-ft` CLI) catch `UserError`, print its message on one
line and exit with status 2; no traceback from deep inside Ray reaches the user. An error that a
restart cannot cure (`StorageFullError`) ends the run from the workers
(`raytrain_ft.core.run_folder.end_run`); the driver raises it (`run_folder.raise_if_ended`).
"""

from __future__ import annotations


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
    checkpoint (`raytrain_ft.checkpoint.checkpointer.Checkpointer.restore`); the message names the checkpoint
    and the item."""


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
