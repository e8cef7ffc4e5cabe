"""Reading one checkpoint folder in this process alone: the one owner of a checkpoint's metadata.

`CheckpointReader(path)` reads DCP's `.metadata` once (what the folder holds: every key, its shape
and dtype) and loads any part of the folder without a process group or a collective: the run
metadata (`run_meta`: fingerprint, MLflow run id, extension history), the step (`step`), small
components (`load`), the tensors under a key (`tensors`). Every reader of a checkpoint outside the
collective restore goes through it: the preflight's compatibility check and `raytrain-ft extend`
(`preflight.newest_checkpoint`), the loop's early read of the data position (`peek`), the export
(`raytrain_ft.model.export`), the tests' weight comparisons (`load_model_state_dict`). The
collective restore (`Checkpointer.restore`) reads on every rank together, through DCP's planner.

By default every byte read is checked against the folder's checksums
(`raytrain_ft.checkpoint.integrity.ChecksummedReader`); `verified=False` reads without the check,
for a caller that verified the whole folder first (the export: `verify_checkpoint`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from raytrain_ft.checkpoint.dcp_internals import FsspecReader
from raytrain_ft.checkpoint.integrity import ChecksummedReader, corruption_of
from raytrain_ft.checkpoint.train_state import KEY_META, KEY_MODEL, KEY_PROGRESS, Pickled, Progress, RunMeta
from raytrain_ft.core.errors import CheckpointError, CorruptCheckpointError
from raytrain_ft.core.run_folder import METADATA_FILE, complete_steps, step_path


class CheckpointReader:
    """One checkpoint folder (`path`: local path or fsspec URL), read in this process alone.

    Raises:
        CheckpointError: no `.metadata` at `path` (absent, or a save that never completed).
        CorruptCheckpointError: (verified) `.metadata` fails its checksum.
    """

    def __init__(self, path: str, verified: bool = True):
        self.path, self.verified = path, verified
        try:
            self.metadata: Metadata = self._reader().read_metadata()
        except FileNotFoundError:
            raise CheckpointError(f"{path} is not a complete checkpoint (no {METADATA_FILE})") from None

    def _reader(self) -> FsspecReader:
        return ChecksummedReader(self.path) if self.verified else FsspecReader(self.path)

    def load(self, components: dict[str, Stateful | torch.Tensor]) -> None:
        """`dcp.load(components)` from the folder in this process alone (`no_dist`: no process group,
        no collective), without DCP's warning that "torch.distributed is disabled" (the intent here;
        a CLI's one-line error must not follow a warning on stderr).

        Raises:
            CheckpointException: from `dcp.load` (`checkpointer.corruption_of` tells a corrupt file).
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(components, storage_reader=self._reader(), no_dist=True)

    def run_meta(self) -> RunMeta:
        """The run metadata the checkpoint holds (`KEY_META`)."""
        meta = RunMeta(fingerprint={})
        self.load({KEY_META: meta})
        return meta

    def step(self) -> int:
        """The optimizer steps the checkpoint's state has taken (`KEY_PROGRESS`)."""
        progress = Progress()
        self.load({KEY_PROGRESS: Pickled(progress)})
        return progress.step

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """Every tensor under the top-level key `prefix` (e.g. `optim`), keys without `prefix.`, CPU."""
        tensors = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in self.metadata.state_dict_metadata.items()
            if k.startswith(prefix + ".") and isinstance(m, TensorStorageMetadata)
        }
        self.load(cast(dict, tensors))
        return {k[len(prefix) + 1 :]: v for k, v in tensors.items()}


def newest_checkpoint(run_root: str) -> tuple[str, RunMeta] | None:
    """(path, run metadata) of the newest intact complete checkpoint under `run_root`; None before
    the first. Corrupt ones (checksums, `raytrain_ft.checkpoint.integrity`) are skipped here: the workers'
    restore falls back past them and records each."""
    for step in reversed(complete_steps(run_root)):
        path = step_path(run_root, step)
        try:
            return path, CheckpointReader(path).run_meta()
        except (CorruptCheckpointError, CheckpointException) as e:  # CheckpointException is a BaseException
            if corruption_of(e) is None:
                raise
    return None


def peek(checkpoint: str | None, components: dict[str, Stateful]) -> None:
    """Load small non-tensor `components` (e.g. the data position) from `checkpoint` on this rank
    alone, with no collective, before the model exists: what the rank can start early (the data
    pipeline) while the full `restore_latest` runs. Leaves them as they are when there is no
    checkpoint or it does not load (the full restore then reports why)."""
    if checkpoint is None:
        return
    with contextlib.suppress(Exception, CheckpointException):  # CheckpointException is a BaseException
        CheckpointReader(checkpoint).load(cast(dict, components))


def load_model_state_dict(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The model weights of any checkpoint folder, as CPU tensors keyed like the HF model's `state_dict`.

    Raises:
        CheckpointError: the folder is not a complete checkpoint.
    """
    return CheckpointReader(checkpoint_dir).tensors(KEY_MODEL)


def load_tensors(checkpoint_dir: str, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under a top-level key (e.g. `optim`) of a checkpoint, flattened keys, CPU."""
    return CheckpointReader(checkpoint_dir).tensors(prefix)
