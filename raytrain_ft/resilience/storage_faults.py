"""Fault-injected checkpoint storage: the DCP writers and readers that `FaultInjector.writer_for` and
`FaultInjector.reader_for` (`raytrain_ft.resilience.faults`, which fault asks for which) hand the
checkpointer in place of `ChecksummedWriter` and `ChecksummedReader`. The checkpointer knows none of
them: it writes with the writer it is given and reads with the reader it is given.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from raytrain_ft.checkpoint.integrity import ChecksummedReader, ChecksummedWriter


class SlowWriter(ChecksummedWriter):
    """Sleeps `delay_s` seconds before writing, after the step folder exists (a fault at `save`,
    `slow_save`)."""

    def __init__(self, path: str, delay_s: float):
        super().__init__(path)
        self.delay_s = delay_s

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


class CutWriter(ChecksummedWriter):
    """SIGKILLs its own process from the save's write thread, after `before_kill()` (the fault's
    marker), at `at` (a `kill` fault at `write` or `metadata`):

    * `write`: once the first item of this rank's plan is on storage, the rest not (its file holds
      that item alone: DCP writes a rank's items into one file per write thread), so the step
      folder holds a file cut short and no `.metadata`;
    * `metadata`: on the save's coordinator (rank 0 of the save's group, the only rank that writes
      `.metadata`), once every rank's files are written, before `.metadata` and `.checksums`.
    """

    def __init__(self, path: str, at: str, before_kill: Callable[[], None]):
        super().__init__(path)
        self.at, self.before_kill = at, before_kill

    def _kill(self) -> None:
        self.before_kill()
        os.kill(os.getpid(), signal.SIGKILL)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.at != "write":
            return super().write_data(plan, planner)
        super().write_data(dataclasses.replace(plan, items=plan.items[:1]), planner)
        self._kill()
        raise AssertionError("unreachable: SIGKILL")

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.at == "metadata":
            self._kill()
        super().finish(metadata, results)


class SlowReader(ChecksummedReader):
    """Sleeps `delay_s` seconds once, before its first item, with that item's file open
    (`slow_restore`)."""

    def __init__(self, path: str, delay_s: float):
        super().__init__(path)
        self.delay_s = delay_s

    def _slice_file(self, file, sinfo):
        time.sleep(self.delay_s)
        self.delay_s = 0.0
        return super()._slice_file(file, sinfo)
