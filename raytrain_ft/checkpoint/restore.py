"""The restore on a start: the newest checkpoint every rank can load, across the memory tier and
durable storage, uncommitted saves deleted first, corrupt ones skipped and recorded."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

from raytrain_ft.checkpoint.checkpointer import Checkpointer, ReaderFor, cleanup
from raytrain_ft.checkpoint.integrity import ChecksummedReader
from raytrain_ft.checkpoint.train_state import TrainState
from raytrain_ft.core.recorder import Recorder
from raytrain_ft.core.run_folder import complete_steps, step_of, step_path

log = logging.getLogger(__name__)


def restore_latest(
    checkpointer: Checkpointer,
    state: TrainState,
    run_root: str,
    latest: str | None,
    recorder: Recorder,
    reader_for: ReaderFor = lambda step: ChecksummedReader,
    clean: bool = True,
    from_memory: Callable[[int], tuple[int, set[str], str] | None] = lambda durable_step: None,
) -> tuple[int | None, set[str], str]:
    """Delete uncommitted saves (unless `clean` is False: a live peer may be writing one, under
    replica recovery), then load the newest checkpoint: the memory tier's when `from_memory(durable
    step)` loads one (`raytrain_ft.checkpoint.memory_tier.MemoryTier.restore`: never older than the
    durable one), else the committed durable one (or an older one if corrupt); `reader_for`:
    `Checkpointer.restore`'s (fault injection).

    `latest`: the checkpoint committed last under `run_root` (`Session.latest_checkpoint`), or None.

    Returns the step loaded (None on a fresh start), the state keys the checkpoint held, and where it
    came from: `memory` (every rank's own node), `peer` (some rank's copy on another node), `storage`, or "".
    """
    committed = step_of(latest) if latest else 0
    if dist.get_rank() == 0 and clean:
        removed = cleanup(run_root, committed)
        if removed:
            log.warning("deleted incomplete or uncommitted checkpoints at steps %s", removed)
            recorder.event("uncommitted_checkpoints_deleted", steps=removed)
    dist.barrier(group=checkpointer.control_group)
    memory = from_memory(committed)
    if memory is not None:
        return memory
    if latest is None:
        return None, set(), ""
    older = [s for s in reversed(complete_steps(run_root)) if s < committed]
    candidates = [latest] + [step_path(run_root, s) for s in older]
    loaded, keys = checkpointer.restore(state, candidates, corrupt_recorder(recorder), reader_for)
    return (step_of(loaded) if loaded else None), keys, "storage"


def corrupt_recorder(recorder: Recorder) -> Callable[[str, str], None]:
    """`Checkpointer.restore`'s `on_corrupt`: the `corrupt_checkpoint` event and the run's last-corrupt tag."""

    def on_corrupt(path: str, reason: str) -> None:
        recorder.event("corrupt_checkpoint", path=path, reason=reason)
        recorder.tags({"last_corrupt_checkpoint": f"{path}: {reason}"})

    return on_corrupt
