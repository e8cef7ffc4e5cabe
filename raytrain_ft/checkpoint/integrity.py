"""Checksums of every byte a checkpoint stores, and the check that a checkpoint is complete.

Written by the writer, from the bytes as written, on the async save's write thread:

- every stored item (a tensor or tensor shard as `torch.save` bytes, a pickled component as its
  bytes) gets an xxh3-64 checksum (`xxhash`) of exactly the bytes DCP wrote for it: the writer's
  stream transform (`ChecksummedWriter`, through `FileSystemWriter`'s transforms, the hook DCP's
  own stream extensions use) hashes each item's stream as DCP writes it;
- `.metadata` gets a checksum of the bytes DCP pickled into it, hashed as they are written;
- all of them go to `<checkpoint>/.checksums` (JSON, `CHECKSUM_FILE`), written by the coordinator
  after `.metadata`; a checkpoint commits only after both (`raytrain_ft.checkpoint.checkpointer`).

Read by `ChecksummedReader`: `.metadata` is verified before it is unpickled, each item's byte
range (hashed in chunks, `_hash_range`) before DCP reads and deserialises it; a thread hashes the
items ahead of DCP, in DCP's order, so the hashing overlaps DCP's reading. A mismatch, a short
read, a missing file or a missing checksum record raises `CorruptCheckpointError` naming the item;
the restore falls back to an older checkpoint. `verify_checkpoint(path)` checks a whole checkpoint
without a process group (the `raytrain-ft verify` command; export tools call it before converting).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pickle
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future as HashFuture
from typing import Any

import fsspec
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from raytrain_ft.checkpoint.dcp_internals import (
    FileSystem,
    FsspecReader,
    FsspecWriter,
    StorageInfo,
    StorageWriterTransforms,
    StreamTransformExtension,
)
from raytrain_ft.checkpoint.train_state import missing_components
from raytrain_ft.core.errors import CorruptCheckpointError
from raytrain_ft.core.run_folder import CHECKSUM_FILE, METADATA_FILE

ALGORITHM = "xxh3_64"


def _digest(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


HASH_CHUNK = 8 << 20  # bytes read per call when hashing a stored range


def _hash_range(f, offset: int, length: int) -> str | None:
    """xxh3-64 of `length` bytes of the open file `f` from `offset`, read in `HASH_CHUNK`s into one
    reused buffer (no allocation the size of the item); None when the file ends first (truncated)."""
    f.seek(offset)
    hasher, view, left = xxhash.xxh3_64(), memoryview(bytearray(min(length, HASH_CHUNK))), length
    while left:
        n = f.readinto(view[: min(left, len(view))])
        if not n:
            return None
        hasher.update(view[:n])
        left -= n
    return hasher.hexdigest()


class _HashingStream(io.RawIOBase):
    """Passes writes through to `raw` and feeds the same bytes to `hasher`; closing it does not close `raw`
    (DCP appends every item of a rank to one file and closes it itself)."""

    def __init__(self, raw, hasher):
        self.raw, self.hasher = raw, hasher

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.hasher.update(b)
        return self.raw.write(b)

    def fileno(self) -> int:  # DCP fsyncs `.metadata` through it
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.flush()
        super().close()


class _HashingTransforms(StorageWriterTransforms):
    """DCP's per-item stream transform hook: wraps each item's output stream in a hasher, innermost,
    so the checksum covers the bytes as stored (after any compression extension)."""

    def __init__(self, extensions: Sequence[StreamTransformExtension] | None) -> None:
        super().__init__(extensions)
        self.hashers: dict[Any, Any] = {}  # WriteItem.index -> xxh3_64 of that item's bytes

    def transform_save_stream(self, write_item: WriteItem, raw_stream):
        hasher = self.hashers[write_item.index] = xxhash.xxh3_64()
        return super().transform_save_stream(write_item, _HashingStream(raw_stream, hasher))


@dataclasses.dataclass
class _CheckedStorageInfo(StorageInfo):
    """A `WriteResult`'s storage info plus its checksum, on its way to the coordinator; `finish` strips the
    checksum so `.metadata` holds DCP's own `StorageInfo` (readable without this module)."""

    checksum: str = ""


class _HashingFileSystem(FileSystem):
    """DCP's fsspec file system that hashes what it writes to `.metadata` (via its `.tmp` file)."""

    metadata_digest = ""

    @contextlib.contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as stream:
            if "w" in mode and str(path).endswith(f"{METADATA_FILE}.tmp"):
                hasher = xxhash.xxh3_64()
                yield _HashingStream(stream, hasher)
                self.metadata_digest = hasher.hexdigest()
            else:
                yield stream


class ChecksummedWriter(FsspecWriter):
    """`FsspecWriter` that checksums every item and `.metadata` as it writes them and records the checksums in
    `<checkpoint>/.checksums` (see the module docstring). Runs wherever DCP runs the write: the async save's
    write thread."""

    transforms: _HashingTransforms

    def __init__(self, path: str, **kwargs):
        super().__init__(path, **kwargs)
        self.fs: _HashingFileSystem = _HashingFileSystem()  # type: ignore[assignment]  # FsspecWriter types it as its base
        self.path = self.fs.init_path(path)
        self.transforms = _HashingTransforms(self.transforms.extensions)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.transforms.hashers.clear()
        results = super().write_data(plan, planner).wait()  # DCP's file writer is synchronous
        checked = [
            WriteResult(
                r.index,
                r.size_in_bytes,
                _CheckedStorageInfo(**vars(r.storage_data), checksum=self.transforms.hashers[r.index].hexdigest()),
            )
            for r in results
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(checked)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        items: dict[str, dict[str, list]] = {}
        plain: list[list[WriteResult]] = []
        for rank_results in results:
            plain.append([])
            for r in rank_results:
                s = r.storage_data
                items.setdefault(s.relative_path, {})[str(s.offset)] = [s.length, s.checksum]
                info = StorageInfo(s.relative_path, s.offset, s.length, s.transform_descriptors)
                plain[-1].append(WriteResult(r.index, r.size_in_bytes, info))
        super().finish(metadata, plain)
        record = {"algorithm": ALGORITHM, METADATA_FILE: self.fs.metadata_digest, "items": items}
        with self.fs.create_stream(self.fs.concat_path(self.path, CHECKSUM_FILE), "wb") as f:
            f.write(json.dumps(record).encode())


def _item_name(metadata: Metadata, relative_path: str, offset: int, length: int) -> str:
    """`fqn (file, bytes a-b)` of the item stored at `offset` of `relative_path` (a shard: its chunk offsets too)."""
    for index, info in metadata.storage_data.items():
        if info.relative_path == relative_path and info.offset == offset:
            chunk = f" chunk at {list(index.offset)}" if index.offset is not None and any(index.offset) else ""
            return f"{index.fqn}{chunk} ({relative_path}, bytes {offset}-{offset + length})"
    return f"{relative_path}, bytes {offset}-{offset + length}"


def _read_metadata(path: str) -> tuple[Metadata, dict]:
    """The checkpoint's `.metadata`, unpickled only after its bytes match its checksum, and its checksum record.

    Raises:
        CorruptCheckpointError: no `.metadata` (not a complete checkpoint), no or an unreadable
            `.checksums`, or `.metadata` fails its checksum.
    """
    base = path.rstrip("/")
    try:
        with fsspec.open(f"{base}/{METADATA_FILE}", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: no {METADATA_FILE} (not a complete checkpoint)") from None
    try:
        with fsspec.open(f"{base}/{CHECKSUM_FILE}", "rb") as f:
            record = json.loads(f.read())
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: no checksum record ({CHECKSUM_FILE})") from None
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: checksum record ({CHECKSUM_FILE}) does not parse: {e}") from None
    if record.get("algorithm") != ALGORITHM or _digest(data) != record.get(METADATA_FILE):
        raise CorruptCheckpointError(f"{path}: {METADATA_FILE} fails its checksum")
    return pickle.loads(data), record


class ChecksummedReader(FsspecReader):
    """`FsspecReader` that verifies `.metadata` and every item it reads against `.checksums` before use.

    `read_metadata` is cached: one instance serves several `dcp.load` calls of one checkpoint with
    one read and check of `.metadata`.

    Raises (from `read_metadata` and `dcp.load`; inside `dcp.load` wrapped in DCP's `CheckpointException`):
        CorruptCheckpointError: naming the item whose bytes do not match, are short, or whose file is missing.
    """

    def __init__(self, path: str, **kwargs):
        super().__init__(path, **kwargs)
        self.checkpoint = str(path)
        self._record: dict | None = None
        self._metadata: Metadata | None = None
        self._hashes: dict[tuple[str, int], HashFuture] = {}  # (file, offset) -> its range's hash, set by `_hash_ahead`

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata, which we never write
            raise CorruptCheckpointError(f"{self.checkpoint}: no {METADATA_FILE}")
        if self._metadata is None:
            self._metadata, self._record = _read_metadata(self.checkpoint)
        return self._metadata

    def read_data(self, plan, planner):
        # DCP reads file by file, each file's items in plan order: the hashing thread goes the same way
        by_file: dict[str, list[StorageInfo]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            by_file.setdefault(info.relative_path, []).append(info)
        self._hashes = {(i.relative_path, i.offset): HashFuture() for infos in by_file.values() for i in infos}
        stop = threading.Event()
        hasher = threading.Thread(target=self._hash_ahead, args=(by_file, stop), name="checksums", daemon=True)
        hasher.start()
        try:
            return super().read_data(plan, planner)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{self.checkpoint}: missing file {e.filename or e}") from None
        finally:
            stop.set()
            hasher.join()

    def _hash_ahead(self, by_file: dict[str, list[StorageInfo]], stop: threading.Event) -> None:
        """Set each item's future to its range's hash (None: the file ends first), in DCP's read order;
        an error (a missing file) goes to every future still unset, so no `_slice_file` waits on it."""
        try:
            for relative_path, infos in by_file.items():
                with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as f:
                    for info in infos:
                        if stop.is_set():
                            return
                        self._hashes[(relative_path, info.offset)].set_result(_hash_range(f, info.offset, info.length))
        except BaseException as e:  # handed to the reader's thread, which raises it from `_slice_file`
            for future in self._hashes.values():
                if not future.done():
                    future.set_exception(e)

    def _slice_file(self, file, sinfo: StorageInfo):
        assert self._metadata is not None and self._record is not None  # read_metadata runs before any read
        expected = self._record["items"].get(sinfo.relative_path, {}).get(str(sinfo.offset))
        # the hashing thread read and hashed the range, one item ahead of here or more: DCP reads it again
        # (the page cache, when local), only once it is verified
        if expected != [sinfo.length, self._hashes[(sinfo.relative_path, sinfo.offset)].result()]:
            name = _item_name(self._metadata, sinfo.relative_path, sinfo.offset, sinfo.length)
            raise CorruptCheckpointError(f"{self.checkpoint}: {name} fails its checksum")
        return super()._slice_file(file, sinfo)


class CompleteLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with a missing entry raised as `CorruptCheckpointError` naming the key
    (DCP's own check raises a bare `RuntimeError`, indistinguishable from a bug).

    Args:
        checkpoint: the checkpoint's path, for the message.
    """

    def __init__(self, checkpoint: str):
        super().__init__()
        self.checkpoint = checkpoint

    def create_local_plan(self):
        saved = self.metadata.state_dict_metadata
        missing = [k for k in self.state_dict if k not in saved]
        if missing:
            raise CorruptCheckpointError(
                f"{self.checkpoint}: incomplete: no {missing[0]!r}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        return super().create_local_plan()


def verify_checkpoint(path: str, components: bool = True) -> list[str]:
    """Every problem of the checkpoint folder `path` (local or fsspec URL), one line each; [] if it is intact.

    Checks, without a process group: the checksum record exists; `.metadata` and every item's bytes
    match their checksums (each item read once); and, with `components`, the checkpoint holds every
    component of a run's train state (`raytrain_ft.checkpoint.train_state.missing_components`; the export,
    which needs only the model, checks its weights itself).
    """
    try:
        metadata, record = _read_metadata(path)
    except CorruptCheckpointError as e:
        return [str(e)]
    problems = []
    by_file: dict[str, list[StorageInfo]] = {}
    for info in metadata.storage_data.values():
        by_file.setdefault(info.relative_path, []).append(info)
    for relative_path, infos in sorted(by_file.items()):
        try:
            f = fsspec.open(f"{path.rstrip('/')}/{relative_path}", "rb").open()
        except FileNotFoundError:
            problems.append(f"{path}: missing file {relative_path}")
            continue
        with f:
            for info in sorted(infos, key=lambda i: i.offset):
                expected = record["items"].get(relative_path, {}).get(str(info.offset))
                if expected != [info.length, _hash_range(f, info.offset, info.length)]:
                    name = _item_name(metadata, relative_path, info.offset, info.length)
                    problems.append(f"{path}: {name} fails its checksum")
    if components:
        problems += [f"{path}: incomplete: {m}" for m in missing_components(metadata.state_dict_metadata)]
    return problems


def corruption_of(e: BaseException) -> CorruptCheckpointError | None:
    """The `CorruptCheckpointError` behind `e` (DCP wraps a rank's error in `CheckpointException`,
    keyed by rank); None when any rank failed for another reason."""
    if isinstance(e, CorruptCheckpointError):
        return e
    errors = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else []
    corrupt = [x for x in errors if isinstance(x, CorruptCheckpointError)]
    return corrupt[0] if corrupt and len(corrupt) == len(errors) else None
