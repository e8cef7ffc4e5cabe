"""Room for a checkpoint on its storage: the free bytes where the run folder is, the newest
checkpoint's size (what the next one needs, about), whether an error was a full disk, and the one
line that says so (`raytrain_ft.checkpoint.checkpointer.Checkpointer.check_space`)."""

from __future__ import annotations

import errno
import os
import shutil

from torch.distributed.checkpoint.api import CheckpointException

from raytrain_ft.core.run_folder import complete_steps, step_path


def space_message(root: str, step: int, needed: int, free: int) -> str:
    return (
        f"checkpoint step-{step} does not fit on {root}: about {needed} bytes needed, {free} bytes free; "
        "free space there, lower checkpoint.num_to_keep, or move run.storage_path"
    )


def free_bytes(root: str) -> int:
    path = root.removeprefix("file://")
    while not os.path.exists(path):  # the run folder before its first save
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def newest_size(root: str) -> int:
    """Bytes of the newest complete checkpoint under `root` (0 before the first one)."""
    complete = complete_steps(root)
    if not complete:
        return 0
    folder = step_path(root, complete[-1]).removeprefix("file://")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def out_of_space(exc: BaseException | None) -> bool:
    """ENOSPC anywhere in the chain or in any rank's error that DCP gathered into its `CheckpointException`
    (`failures`), or torch's zip writer failing on a short write."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if "unexpected pos" in str(exc) or "No space left" in str(exc):
            return True
        if isinstance(exc, CheckpointException) and any(out_of_space(e) for e, _ in exc.failures.values()):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
