"""This rank's batches of each step: the data pipeline read from a data position, at any split.

`check_data_fits`: the dataset can feed the run (also a preflight check). `Batches.take`: this rank's
`grad_accum_steps` passes of the step at a data position (`split_passes`), read ahead from one stream
(`Session.micro_batches`) and read again when the position or the split moves; every read within
`waits.data_timeout_s`. The micro-batches are numpy arrays until `split_passes` makes them tensors: what
reads them (Ray Data's read tasks, `raytrain_ft.data.order`) imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

from raytrain_ft.core.config import Config
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.core.waits import bounded
from raytrain_ft.data.manifest import Manifest
from raytrain_ft.data.order import steps_per_epoch
from raytrain_ft.data.position import BatchPlan, DataPosition, Share


class BatchSource(Protocol):
    """Where a rank's micro-batches come from: the part of `raytrain_ft.training.session.Session`
    this module uses (Ray Data's shard on a Ray worker, the dataset's files without Ray)."""

    @property
    def rank(self) -> int:
        """This worker's rank (for messages)."""
        ...

    def micro_batches(
        self, epoch: int, start: int, stop: int, plan: BatchPlan, rank: int
    ) -> Iterator[dict[str, np.ndarray]]:
        """`Session.micro_batches`: the micro-batches of `rank` of `plan` for steps [start, stop) of `epoch`."""
        ...


def check_data_fits(cfg: Config, manifest: Manifest) -> None:
    """Raises ConfigError when `train.seq_len` disagrees with the dataset or it cannot fill one step."""
    if cfg.train.seq_len not in (0, manifest.seq_len):
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} but the dataset has seq_len {manifest.seq_len}")
    if cfg.train.global_batch_size > manifest.num_samples:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} exceeds the {manifest.num_samples} samples "
            f"of {cfg.data.path}"
        )
    steps_per_epoch(manifest, cfg.train.global_batch_size, cfg.train.micro_batch_size)


def split_passes(
    plan: BatchPlan, rank: int, lane_batches: list[dict[str, np.ndarray]]
) -> list[dict[str, torch.Tensor]]:
    """Cut one step of `rank`'s lane micro-batches into its `plan.grad_accum_steps` passes (the split:
    `raytrain_ft.data.position`).

    Args:
        lane_batches: one micro-batch per lane of `plan.lanes(rank)`, in order (`Session.micro_batches`);
            each `tokens` int64 (m, seq_len + 1), `sample_id` int64 (m,); numpy arrays or tensors.
    Returns:
        `grad_accum_steps` dicts of tensors with the same keys and n rows each, n = the pass's share
        of the rank's span (differing by at most one between passes; 0 for a zero-weight pass).
    """
    lo, hi = plan.span(rank)
    offset = plan.lanes(rank)[0] * plan.micro_batch_size
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(plan.grad_accum_steps)]
    for key in lane_batches[0]:
        span = torch.cat([torch.as_tensor(mb[key]) for mb in lane_batches])[lo - offset : hi - offset]
        for i, part in enumerate(torch.tensor_split(span, plan.grad_accum_steps)):
            out[i][key] = part
    return out


def step_batches(
    session: BatchSource, position: DataPosition, plan: BatchPlan, rank: int, steps_per_epoch: int
) -> Iterator[list]:
    """Endless iterator over steps; each item is this rank's `grad_accum_steps` passes (`split_passes`)."""
    epoch, start = position.epoch, position.consumed // plan.global_batch_size
    lanes = len(plan.lanes(rank))
    while True:
        micro = session.micro_batches(epoch, start, steps_per_epoch, plan, rank)
        for _ in range(steps_per_epoch - start):
            yield split_passes(plan, rank, [next(micro) for _ in range(lanes)])
        epoch, start = epoch + 1, 0


def started(batches: Iterator[list]) -> Iterator[list]:
    """`batches`, its first item fetched from now on in a background thread: the data pipeline
    starts (Ray Data: read tasks, their worker processes) while the model builds and loads."""
    fetching = ThreadPoolExecutor(1, thread_name_prefix="first-batch")  # named in stack dumps
    first = fetching.submit(next, batches)
    fetching.shutdown(wait=False)  # the thread ends once the first item is fetched

    def chained() -> Iterator[list]:
        yield first.result()
        yield from batches

    return chained()


class Batches:
    """This rank's passes of each step (`take`), read ahead from one stream while the steps follow
    each other; read again from the data position when a step is not the one the stream is at: the
    split changed (a replica quorum of another size), the position moved (a restore of an older
    checkpoint, a rollback, a heal), or a step was not accepted (`Replicas.accepted`: the same passes
    are returned again)."""

    def __init__(
        self, session: BatchSource, steps_per_epoch: int, position: DataPosition, share: Share, timeout_s: float
    ):
        self.session, self.steps_per_epoch, self.timeout_s = session, steps_per_epoch, timeout_s
        self.stream = started(self._read(position, share))
        self.next_key: tuple = (position.epoch, position.consumed, share)
        self.last_key: tuple | None = None
        self.last: list = []

    def take(self, position: DataPosition, share: Share) -> list:
        """The passes of the step at `position` for `share` (`split_passes`)."""
        key = (position.epoch, position.consumed, share)
        if key == self.last_key:
            return self.last
        if key != self.next_key:
            self.stream = self._read(position, share)
        self.last, self.last_key = next(self.stream), key
        after = DataPosition(position.epoch, position.consumed)
        after.advance(share.plan.global_batch_size, self.steps_per_epoch)
        self.next_key = (after.epoch, after.consumed, share)
        return self.last

    def _read(self, position: DataPosition, share: Share) -> Iterator[list]:
        """The steps from `position`, each within `waits.data_timeout_s` (`waits.bounded`)."""
        what = f"rank {self.session.rank}: the data pipeline (epoch {position.epoch}, from sample {position.consumed})"
        steps = step_batches(self.session, position, share.plan, share.rank, self.steps_per_epoch)
        return bounded(steps, self.timeout_s, what)
