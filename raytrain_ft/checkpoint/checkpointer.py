"""Async sharded checkpoints with `torch.distributed.checkpoint`, committed only when complete.

Life of a checkpoint (see docs/restart-recovery.md):

1. `save(step)`: `dcp.async_save` into `<root>/step-<N>` through a checksumming fsspec writer
   (`raytrain_ft.checkpoint.integrity`: every item and `.metadata` hashed as written, on the write thread),
   on a dedicated
   gloo group so checkpoint collectives never interleave with training collectives. The snapshot
   (staging) is a copy; `wait_staged()` is called before the next optimizer step, so training
   only stalls if the copy is not finished by then. At most one save is in flight: a new save
   first finishes the previous one.
2. `poll()` (every step) asks all ranks, with one small all-reduce on a second gloo group, whether
   their write finished. DCP's coordinator writes `.metadata` only after every rank's write, so
   "all done" means the folder is complete: `poll()` (and `wait()`) return its step, and the
   caller commits it (`Session.commit`; the loop's `Commits.after_commit`). The words: see the
   glossary in docs/architecture.md.
3. On start, `cleanup()` deletes every `step-*` folder newer than the committed one or without
   `.metadata` (a save that never completed), and `restore()` loads the committed checkpoint, every
   byte verified against its checksum and every component required, falling back to older complete
   ones when one is corrupt or incomplete (`CorruptCheckpointError`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import fsspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from raytrain_ft.checkpoint.fingerprint import carry_start, check_fingerprint
from raytrain_ft.checkpoint.integrity import ChecksummedReader, ChecksummedWriter, CompleteLoadPlanner, corruption_of
from raytrain_ft.checkpoint.storage_space import free_bytes, newest_size, out_of_space, space_message
from raytrain_ft.checkpoint.train_state import KEY_META, RunMeta, TrainState, missing_components
from raytrain_ft.core.errors import CheckpointError, CorruptCheckpointError, StorageFullError
from raytrain_ft.core.run_folder import list_step_dirs, step_of, step_path
from raytrain_ft.core.waits import WaitTimeoutError

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

WriterFactory = Callable[[str], ChecksummedWriter]  # the storage writer of a save, from its step folder's path
ReaderFor = Callable[[int], Callable[[str], ChecksummedReader]]  # a checkpoint's step -> its reader, from its path


def cleanup(root: str, committed_step: int) -> list[int]:
    """Delete folders of saves that never committed; return their steps (rank 0 only)."""
    removed = [s for s, complete in list_step_dirs(root).items() if s > committed_step or not complete]
    for s in removed:
        fs, base = fsspec.core.url_to_fs(step_path(root, s))
        fs.rm(base, recursive=True)
    return sorted(removed)


def prune(root: str, committed_step: int, keep: int) -> list[int]:
    """Delete every `step-N` folder older than `committed_step` but the `keep - 1` newest complete
    ones (so `keep` committed checkpoints remain), incomplete ones included; return their steps.
    For commits made without Ray Train, whose `CheckpointConfig(num_to_keep)` does this otherwise
    (replica recovery: `raytrain_ft.launch.worker.ReplicaSession`). Only the committing writer calls
    it: no other writes an older step."""
    older = list_step_dirs(root)
    kept = sorted((s for s, done in older.items() if done and s < committed_step), reverse=True)[: keep - 1]
    removed = sorted(s for s in older if s < committed_step and s not in kept)
    for s in removed:
        fs, base = fsspec.core.url_to_fs(step_path(root, s))
        fs.rm(base, recursive=True)
    return removed


class Checkpointer:
    """One rank's side of async save, collective commit and restore.

    Args:
        root: the run's folder (local path or fsspec URL); checkpoints go to `root/step-N`.
        timeout_s: the timeout of its two gloo groups' collectives (`failure.collective_timeout_s`;
            without it torch gives a new group 30 minutes, whatever the default group's timeout).
        save_group, control_group: the groups DCP saves and loads over and the one the ranks agree
            over; None: a new gloo group of every rank each (the memory tier passes a group of this
            rank alone for its saves and the durable checkpointer's control group).
    """

    def __init__(
        self,
        root: str,
        timeout_s: float = 600.0,
        save_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
    ):
        self.root, self.timeout_s = root, timeout_s
        timeout = timedelta(seconds=timeout_s)
        self.save_group = save_group or dist.new_group(backend="gloo", timeout=timeout)
        self.control_group = control_group or dist.new_group(backend="gloo", timeout=timeout)
        self.pending: tuple[int, str, Future] | None = None  # (step, path, upload future)
        self.staging: Future | None = None  # future of the snapshot copy still in progress
        self.stall_s = 0.0  # seconds training was blocked in save() / wait_staged(), since start
        self.last_cost_s = self.last_duration_s = 0.0  # of the last completed save: its stall; start to complete
        self._started = self._pending_stall = self._stall_taken = 0.0
        cuda = torch.cuda.is_available()
        # Pinned host memory + non-blocking copies on GPU; on CPU a plain background copy.
        self.stager = DefaultStager(StagingOptions(cuda, False, True, cuda))

    def save(self, step: int, state: TrainState, writer: WriterFactory = ChecksummedWriter) -> None:
        """Start an async save of `state` as `step-<step>`, written by `writer(path)` (a fault-injected
        one: `raytrain_ft.resilience.storage_faults`).

        Raises:
            RuntimeError: a save is still in flight (at most one is: `wait()` for it first, and
                commit the step it returns).
        """
        if self.pending is not None:
            raise RuntimeError(f"step-{self.pending[0]} is still in flight: wait() for it before saving step-{step}")
        t0 = time.perf_counter()
        self.check_space(step)
        path = step_path(self.root, step)
        response = dcp.async_save(
            state.snapshot(),
            storage_writer=self._writer(path, step, writer),
            process_group=self.save_group,
            async_stager=self.stager,
        )
        if isinstance(response, AsyncSaveResponse):
            self.staging, upload = response.staging_completion, response.upload_completion
        else:
            self.staging, upload = None, response
        self.pending = (step, path, upload)
        self._started, self._pending_stall = t0, 0.0
        self._stalled(t0)

    def _writer(self, path: str, step: int, writer: WriterFactory) -> ChecksummedWriter:
        """The storage writer of the save of `step` into `path`."""
        return writer(path)

    def check_space(self, step: int) -> None:
        """On local storage, before a save: raise on every rank (rank 0 measures, all agree) when the
        free bytes are fewer than the newest complete checkpoint's size, the expected size of this
        one. Object stores cannot tell their free space: no check there.

        Raises:
            StorageFullError: one line with the storage, bytes needed and free, and the fixes.
        """
        local = "://" not in self.root or self.root.startswith("file://")
        if not local:
            return
        room = torch.zeros(2, dtype=torch.float64)
        if dist.get_rank() == 0:
            room[0], room[1] = free_bytes(self.root), newest_size(self.root)
        dist.broadcast(room, src=0, group=self.control_group)
        free, needed = int(room[0].item()), int(room[1].item())
        if needed > free:
            raise StorageFullError(space_message(self.root, step, needed, free))

    def wait_staged(self) -> None:
        """Block until the snapshot copy is finished; call before anything mutates the state."""
        t0 = time.perf_counter()
        if self._finish_staging():
            self._stalled(t0)

    def _finish_staging(self) -> bool:
        """Wait for the snapshot copy, if one is in progress; True if there was one."""
        if self.staging is None:
            return False
        try:
            self.staging.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise WaitTimeoutError(self._late("snapshot copy", self.pending[0] if self.pending else 0)) from None
        self.staging = None
        return True

    def take_stall_s(self) -> float:
        """Seconds training was blocked on checkpoints since the previous call."""
        stall, self._stall_taken = self.stall_s - self._stall_taken, self.stall_s
        return stall

    def _stalled(self, since: float) -> None:
        blocked = time.perf_counter() - since
        self.stall_s += blocked
        self._pending_stall += blocked

    def poll(self) -> int | None:
        """The step of the pending save if every rank finished writing it (the checkpoint is
        complete, the caller commits it), else None. A collective on every rank.

        Raises: as `wait()`, for a write that failed."""
        if self.pending is None:
            return None
        flag = torch.tensor([int(self.pending[2].done())], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control_group)
        return self._complete() if flag.item() == 1 else None

    def wait(self) -> int | None:
        """Finish the pending save, if any, on every rank; return its step (the checkpoint is
        complete, the caller commits it), None when no save was in flight.

        Raises:
            StorageFullError, WaitTimeoutError, CheckpointException: see `_written`.
        """
        if self.pending is None:
            return None
        t0 = time.perf_counter()
        self._finish_staging()
        self._written(*self.pending[::2])
        dist.barrier(group=self.control_group)
        self._stalled(t0)  # all of it: training waits here (final save, settle before a fault or alert)
        return self._complete()

    def _written(self, step: int, upload) -> None:
        """Wait for this rank's write; a write that ran out of space becomes one line.

        Raises:
            StorageFullError: the write ran out of space (ENOSPC on any rank: DCP raises it on every rank).
            WaitTimeoutError: the write did not finish within `timeout_s` (a counted failure: Ray restarts).
            CheckpointException: DCP's own error (a `BaseException`) for any other failed write, as it is.
        """
        try:
            upload.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise WaitTimeoutError(self._late("write", step)) from None
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            if out_of_space(e):
                needed, free = newest_size(self.root), free_bytes(self.root)
                raise StorageFullError(space_message(self.root, step, needed, free)) from None
            raise

    def _late(self, stage: str, step: int) -> str:
        return (
            f"rank {dist.get_rank()}: checkpoint step-{step}'s {stage} did not finish within {self.timeout_s:g} s "
            "(failure.collective_timeout_s); the storage is stalled or too slow for the bound"
        )

    def _complete(self) -> int:
        """Every rank's write of the pending save finished: clear it and return its step."""
        assert self.pending is not None
        step, _, upload = self.pending
        self._written(step, upload)  # re-raises a failed write: a failed save never completes
        self.pending = None
        self.last_cost_s, self.last_duration_s = self._pending_stall, time.perf_counter() - self._started
        return step

    def restore(
        self,
        state: TrainState,
        candidates: list[str],
        on_corrupt: Callable[[str, str], None],
        reader_for: ReaderFor = lambda step: ChecksummedReader,
    ) -> tuple[str | None, set[str]]:
        """Load the first usable checkpoint of `candidates` (newest first) into `state`, each read by
        `reader_for(its step)(path)` (a fault-injected one: `raytrain_ft.resilience.storage_faults`).

        Every byte is verified before use (`raytrain_ft.checkpoint.integrity.ChecksummedReader`) and the
        checkpoint must hold every component of `state` and every entry of each
        (`missing_components`, `CompleteLoadPlanner`; a rank an elastic resize added may lack its
        RNG entry). A candidate that fails either (`CorruptCheckpointError`,
        raised alike on every rank: DCP gathers a rank's read error to all) is reported through
        `on_corrupt(path, reason)` and the next one is tried. A candidate may be partly loaded into
        `state` before its corrupt item is reached; the next candidate then loads every component.
        Any other error propagates: a bug in the restore must not pass for a fallback.

        Returns:
            (the path loaded, the state keys it held); (None, set()) when `candidates` is empty.

        Raises:
            CheckpointError: a checkpoint from another model/dataset, or none of the candidates
                loads (one line naming each and what is wrong with it).
        """
        problems = []
        for path in candidates:
            try:
                return path, self._load(path, state, reader_for(step_of(path))(path))
            except (CorruptCheckpointError, CheckpointException) as e:  # CheckpointException is a BaseException
                corrupt = corruption_of(e)
                if corrupt is None:
                    raise
                reason = str(corrupt)
                log.error("checkpoint %s is unusable (%s); falling back to the previous one", path, reason)
                on_corrupt(path, reason)
                problems.append(reason)
        if candidates:
            raise CheckpointError(
                f"none of the committed checkpoints under {self.root} loads: {'; '.join(problems)}; "
                "restore the damaged files from a copy, or delete the run folder (or pick a new run.name) "
                "to start from scratch"
            )
        return None, set()

    def _load(self, path: str, state: TrainState, reader: ChecksummedReader) -> set[str]:
        """Load checkpoint `path` into `state` with `reader` (of `path`); return the component keys loaded."""
        # reads and checks .metadata once, here, for every load below
        saved = reader.read_metadata().state_dict_metadata
        missing = missing_components(saved, state.components)
        if missing:
            raise CorruptCheckpointError(f"{path}: incomplete: {', '.join(missing)}")
        self._check_compatible(reader, path, state)
        # the run metadata is this config's (its fingerprint, and the history `_check_compatible` carried over)
        loadable = {
            k: c for k, c in state.components.items() if k != KEY_META and any(s.startswith(k + ".") for s in saved)
        }
        state.allocate(saved)
        dcp.load(loadable, storage_reader=reader, planner=CompleteLoadPlanner(path), process_group=self.save_group)
        return set(loadable)

    def _check_compatible(self, reader: ChecksummedReader, path: str, state: TrainState) -> None:
        current = cast(RunMeta, state.components[KEY_META])
        saved = RunMeta(fingerprint={})
        dcp.load({KEY_META: saved}, storage_reader=reader, process_group=self.save_group)
        planned = check_fingerprint(path, saved.fingerprint, current.fingerprint)
        current.fingerprint = carry_start(saved.fingerprint, current.fingerprint)
        current.history = saved.history
        if planned is not None:  # an extension (`raytrain-ft extend`, checked by the driver first)
            target = current.fingerprint["train.max_steps"]
            current.history = [
                *saved.history,
                {"at_step": step_of(path), "from_max_steps": planned, "max_steps": target},
            ]
        current.mlflow_run_id = current.mlflow_run_id or saved.mlflow_run_id
