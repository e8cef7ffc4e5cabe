"""`manifest.json`: what a prepared dataset holds and where each sample lives.

A dataset folder (local path or fsspec URL) contains parquet shards with one column, `tokens`
(fixed-size list<int32> of length `seq_len + 1`), the tokenizer file, and this manifest. Sample ids
are dense 0..N-1: a shard's rows are `first_sample_id`, `first_sample_id + 1`, ... in file order.
Each shard is split into row groups; a row group is the unit the loader permutes and reads (see
`raytrain_ft.data.order`).

A dataset may also hold a validation split (`Manifest.validation`): the packed sequences of
documents held out of the training split (`raytrain_ft.data.prepare`, module doc), as shards of
the same format in the `validation/` subfolder, with their own dense sample ids 0..n-1.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import fsspec

from raytrain_ft.core.errors import DataError

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Shard:
    file: str  # file name inside the dataset folder
    first_sample_id: int
    num_samples: int
    row_group_rows: list[int]  # rows per parquet row group, in file order


@dataclass(frozen=True)
class Split:
    """The validation split: `shards` (file names relative to `folder`) and its counts."""

    folder: str  # subfolder of the dataset folder
    num_samples: int
    shards: list[Shard]
    documents: int  # documents held out of the training split
    tokens: int
    dropped_tokens: int


@dataclass(frozen=True)
class Manifest:
    num_samples: int
    seq_len: int  # tokens per sample = seq_len + 1 (inputs and shifted labels)
    vocab_size: int
    eos_token_id: int
    tokenizer_file: str
    fingerprint: str  # sha256 of the inputs' identities, the tokenizer and the settings (raytrain_ft.data.prepare)
    shards: list[Shard]
    documents: int = 0  # non-empty input documents of the training split
    tokens: int = 0  # their tokens, one EOS per document included
    dropped_tokens: int = 0  # tokens cut at the end of each packed batch (not in any sample)
    validation: Split | None = None  # the held-out documents; None: prepared without a split

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        d = json.loads(text)
        d["shards"] = [Shard(**s) for s in d["shards"]]
        if d.get("validation"):
            v = d["validation"]
            d["validation"] = Split(**{**v, "shards": [Shard(**s) for s in v["shards"]]})
        return cls(**d)


def manifest_url(path: str) -> str:
    return path.rstrip("/") + "/" + MANIFEST


def load_manifest(path: str) -> Manifest:
    """Read the manifest of the dataset at `path` (folder or URL).

    Raises:
        DataError: no dataset there, the manifest is unreadable, or the path is unreachable.
    """
    url = manifest_url(path)
    try:
        with fsspec.open(url, "r") as f:
            return Manifest.from_json(f.read())
    except FileNotFoundError:
        raise DataError(
            f"no prepared dataset at {path} ({MANIFEST} missing); run "
            f"`python jobs/prepare_data.py --output {path}` or set data.path"
        ) from None
    except (ValueError, TypeError, KeyError) as e:
        raise DataError(f"dataset manifest {url} is unreadable ({e}); prepare the dataset again") from None
    except Exception as e:  # fsspec backends raise their own types (no credentials, no such bucket)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot read {url} ({reason}); check data.path and its credentials") from None
