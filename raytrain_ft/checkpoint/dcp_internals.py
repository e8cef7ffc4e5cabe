"""The one module that imports torch's private Distributed Checkpoint (DCP) names; everything else
uses DCP's public API. Checked against torch 2.9 to 2.14 (`pyproject.toml`'s range; CI runs 2.13.0):
a torch upgrade that moves them breaks this file alone (`tests/unit/test_import_rules.py` keeps
every other module off them).

- `FsspecWriter`, `FsspecReader`, `FileSystem` (`torch.distributed.checkpoint._fsspec_filesystem`):
  DCP's storage on any fsspec URL (`s3://`, `gs://`, local); the public `FileSystemWriter` and
  `FileSystemReader` take local paths only. `integrity.ChecksummedWriter` / `ChecksummedReader`
  subclass them to checksum every item as it is written and verify it as it is read, and
  `reader.py` reads a checkpoint's metadata and tensors outside a process group.
- `StreamTransformExtension` (`._extension`): the per-item stream transform the writer hashes through.
- `_StorageInfo`, `_StorageWriterTransforms` (`.filesystem`): each item's storage record (relative
  path, offset, length), which the checksums are keyed by and which `.metadata` stores, and the
  writer's chain of stream transforms.
"""

from torch.distributed.checkpoint._extension import StreamTransformExtension
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo as StorageInfo
from torch.distributed.checkpoint.filesystem import _StorageWriterTransforms as StorageWriterTransforms

__all__ = [
    "FileSystem",
    "FsspecReader",
    "FsspecWriter",
    "StorageInfo",
    "StorageWriterTransforms",
    "StreamTransformExtension",
]
