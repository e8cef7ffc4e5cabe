"""Turn a text corpus into packed, fixed-length token sequences (parquet shards + manifest).

Input: an fsspec path, folder or glob of `.txt`, `.md`, `.py`, `.jsonl` (field `text`) or
`.parquet` (column `text`) files. Default: the running Python's standard library sources, so the
demo needs no download. Steps: train a byte-level BPE tokenizer on the corpus (HF `tokenizers`),
tokenize every document, join documents with the EOS token, cut the stream into sequences of
`seq_len + 1` tokens (the last partial sequence is dropped) and write them with dense sample ids.

The manifest is written last and only a folder with a manifest counts as a dataset, on local disks
and object stores alike (which have no atomic folder rename). Re-running with the same inputs and
settings (same fingerprint) reuses the dataset; different settings delete it first and write a
new one: never a mix.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from raytrain_ft.data.manifest import Manifest, Shard, load_manifest
from raytrain_ft.errors import DataError

EOS = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".parquet")
SAMPLES_PER_SHARD = 8192
ENCODE_BATCH = 256  # documents per tokenizer call (it parallelises inside a batch)


@dataclass(frozen=True)
class PrepareSettings:
    seq_len: int = 256
    vocab_size: int = 8192
    rows_per_row_group: int = 512  # the unit the loader reads; see raytrain_ft.data.order for smaller ones


def default_corpus() -> str:
    """The standard library's `.py` files of the running Python (about 30 MB of real code)."""
    return os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")


def list_inputs(pattern: str) -> list[str]:
    """Expand a file, folder or glob into the sorted list of supported files.

    Raises:
        DataError: nothing matches.
    """
    fs, root = fsspec.core.url_to_fs(pattern)
    if fs.isdir(root):
        root = root.rstrip("/") + "/**"
    paths = fs.glob(root) if any(c in root for c in "*?[") else [root] if fs.exists(root) else []
    files = sorted(
        p for p in paths if p.endswith(TEXT_SUFFIXES) and "site-packages" not in p.split("/") and fs.isfile(p)
    )
    if not files:
        raise DataError(f"no input files match {pattern} (supported: {', '.join(TEXT_SUFFIXES)})")
    return [fs.unstrip_protocol(p) if fs.protocol not in ("file", ("file", "local")) else p for p in files]


def read_documents(files: list[str]) -> Iterator[str]:
    """Yield the non-empty documents of every input file.

    Raises:
        DataError: a parquet or jsonl file cannot be parsed.
    """
    for url in files:
        with fsspec.open(url, "rb") as f:
            raw = f.read()
        if url.endswith(".parquet"):
            yield from _parquet_texts(url, raw)
        elif url.endswith(".jsonl"):
            yield from _jsonl_texts(url, raw)
        else:
            text = raw.decode("utf-8", errors="replace")
            if text.strip():
                yield text


def _parquet_texts(url: str, raw: bytes) -> Iterator[str]:
    try:
        table = pq.read_table(io.BytesIO(raw), columns=["text"])
    except (pa.ArrowInvalid, KeyError) as e:
        raise DataError(f"cannot read {url} as parquet with a 'text' column: {str(e).splitlines()[0]}") from None
    yield from (t for t in table.column("text").to_pylist() if t and t.strip())


def _jsonl_texts(url: str, raw: bytes) -> Iterator[str]:
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{url} line {n} is not a JSON object with a 'text' field") from None
        if text and text.strip():
            yield text


def fingerprint(files: list[str], settings: PrepareSettings) -> str:
    """sha256 over the settings and every input file's name and contents."""
    h = hashlib.sha256(json.dumps(settings.__dict__, sort_keys=True).encode())
    for url in files:
        h.update(url.encode())
        with fsspec.open(url, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def train_tokenizer(documents: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) with `EOS` as its only special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tok


def pack(documents: list[str], tok: Tokenizer, seq_len: int) -> np.ndarray:
    """Tokenize, join with EOS and cut into an int32 array of shape (num_samples, seq_len + 1)."""
    eos = tok.token_to_id(EOS)
    pieces = []
    with tqdm(total=len(documents), desc="tokenizing", unit="doc") as bar:
        for i in range(0, len(documents), ENCODE_BATCH):
            for enc in tok.encode_batch(documents[i : i + ENCODE_BATCH]):
                pieces.append(np.asarray(enc.ids, dtype=np.int32))
                pieces.append(np.asarray([eos], dtype=np.int32))
            bar.update(min(ENCODE_BATCH, len(documents) - i))
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def write_shards(fs, folder: str, samples: np.ndarray, rows_per_row_group: int) -> list[Shard]:
    """Write `samples` as parquet shards of `SAMPLES_PER_SHARD` rows, row groups of `rows_per_row_group`."""
    shards = []
    for first in range(0, len(samples), SAMPLES_PER_SHARD):
        chunk = samples[first : first + SAMPLES_PER_SHARD]
        name = f"shard-{len(shards):05d}.parquet"
        table = pa.table(
            {
                "sample_id": pa.array(np.arange(first, first + len(chunk), dtype=np.int64)),
                "tokens": pa.FixedSizeListArray.from_arrays(pa.array(chunk.reshape(-1)), chunk.shape[1]),
            }
        )
        with fs.open(f"{folder}/{name}", "wb") as f:
            pq.write_table(table, f, row_group_size=rows_per_row_group)
        groups = [min(rows_per_row_group, len(chunk) - g) for g in range(0, len(chunk), rows_per_row_group)]
        shards.append(Shard(name, first, len(chunk), groups))
    return shards


def prepare(input_pattern: str | None, output: str, settings: PrepareSettings) -> tuple[Manifest, bool]:
    """Prepare the dataset at `output`; return (manifest, reused).

    Raises:
        DataError: no input files, no non-empty document, unreadable input, or a corpus too
            small for one sequence.
    """
    if settings.seq_len < 1 or settings.vocab_size < 257 or settings.rows_per_row_group < 1:
        raise DataError(
            f"need --seq-len >= 1, --vocab-size >= 257 (the byte alphabet + EOS) and --rows-per-row-group >= 1, "
            f"got {settings}"
        )
    files = list_inputs(input_pattern or default_corpus())
    fp = fingerprint(files, settings)
    try:
        existing = load_manifest(output)
        if existing.fingerprint == fp:
            return existing, True
    except DataError:
        pass
    documents = list(tqdm(read_documents(files), total=len(files), desc="reading", unit="file"))
    if not documents:
        raise DataError(f"all {len(files)} input files matching {input_pattern} are empty")
    tok = train_tokenizer(documents, settings.vocab_size)
    samples = pack(documents, tok, settings.seq_len)
    if len(samples) == 0:
        raise DataError(f"the corpus has fewer than {settings.seq_len + 1} tokens; lower --seq-len or add text")
    fs, out = fsspec.core.url_to_fs(output)
    out = out.rstrip("/")
    if fs.exists(out) and fs.ls(out):
        if not fs.exists(f"{out}/manifest.json"):
            raise DataError(f"{output} exists and is not a prepared dataset; choose another --output")
        fs.rm(out, recursive=True)  # the old manifest goes with it: a half-written folder is never a dataset
    fs.makedirs(out, exist_ok=True)
    with fs.open(f"{out}/{TOKENIZER_FILE}", "w") as f:
        f.write(tok.to_str())
    manifest = Manifest(
        num_samples=len(samples),
        seq_len=settings.seq_len,
        vocab_size=tok.get_vocab_size(),
        eos_token_id=tok.token_to_id(EOS),
        tokenizer_file=TOKENIZER_FILE,
        fingerprint=fp,
        shards=write_shards(fs, out, samples, settings.rows_per_row_group),
    )
    with fs.open(f"{out}/manifest.json", "w") as f:  # written last: it marks the dataset complete
        f.write(manifest.to_json())
    return manifest, False
