"""Dataset preparation without Ray: inputs, documents, the validation split, the tokenizer, packing, the fingerprint.

`raytrain_ft.launch.prepare.prepare` runs these on Ray Data (`jobs/prepare_data.py`); the output is parquet
shards of packed, fixed-length token sequences plus a manifest (`raytrain_ft.data.manifest`).

Input: an fsspec path, folder or glob of `.txt`, `.md`, `.py` (one document per file), `.jsonl`,
`.jsonl.gz`, `.jsonl.zst` (one document per line, field `text`) or `.parquet` (column `text`)
files. Default: the running Python's standard library sources, so the demo needs no download.

The validation split is chosen by document, never by sequence, so no document contributes to
both splits: a document is identified by its input file and its index among that file's
non-empty documents, and its key is a 63-bit hash of `(seed, file, index)` (`document_key`). A
first pass over the files (read and parsed, not tokenized) counts the `D` documents and keeps the
`validation_max_docs` smallest keys (bounded memory: one heap in the driver, one per read task);
the `k = min(max(round(validation_fraction x D), validation_min_docs), validation_max_docs, D // 2)`
documents with the smallest keys are held out. The draw depends on the seed and the documents'
identities alone, so a re-run chooses the same documents. The training pass skips them (same
shards, same format as without a split: the data order is unchanged); a last pass reads only the
files holding them and packs them into `validation/` the same way. The cost is one extra read of
the corpus (no tokenization) and of the held-out documents' files. `--validation-fraction 0
--validation-min-docs 0` prepares no split (and skips the count). Defaults: 0.5 %, at least 16 and
at most 10,000 documents (the cap bounds the split's read and a whole-split validation).

Tokenizer: a given Hugging Face `tokenizer.json` (EOS from `eos_token` or the first of
`EOS_CANDIDATES` among its special tokens), or a byte-level BPE trained on the first
`tokenizer_sample_docs` training-split documents in the interleaved order (streamed: the read
stops there). Either way it is saved as `tokenizer.json` next to the shards, and the vocabulary
size is the tokenizer's.

Never a mix: an input file is identified by its path, size and modification time (or the object
store's ETag when the filesystem reports one): hashing every byte of a 500 GB corpus is not
practical, and a file rewritten in place with the same size and mtime goes unnoticed. The
fingerprint covers these, the tokenizer file's contents and every setting. The folder gets a
`PREPARING` marker first and the manifest last; only a folder with a manifest counts as a dataset
(object stores have no atomic folder rename). A re-run with the same fingerprint reuses the
dataset; a different fingerprint, or a marker left by a crashed run, deletes the folder and starts
clean; a folder holding anything else is refused.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import io
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from raytrain_ft.core.errors import DataError
from raytrain_ft.data.manifest import Manifest

EOS = "<|endoftext|>"  # the EOS of a trained tokenizer
EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
TOKENIZER_FILE = "tokenizer.json"
MARKER = "PREPARING"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
COMPRESSION = {".gz": "gzip", ".zst": "zstd"}
READ_BATCH_DOCS = 64  # documents per block out of a read task (and per parquet read)
STATS = ("documents", "tokens", "dropped")  # counted per packed batch, summed per shard
VALIDATION_FOLDER = "validation"


@dataclass(frozen=True)
class PrepareSettings:
    seq_len: int = 256
    vocab_size: int = 8192  # of a trained tokenizer; a given one brings its own
    rows_per_row_group: int = 512  # the unit the loader reads; see raytrain_ft.data.order for smaller ones
    tokenizer: str | None = None  # path or URL of a Hugging Face tokenizer.json; None = train one
    eos_token: str | None = None  # with `tokenizer`: its EOS token (default: found among its special tokens)
    tokenizer_sample_docs: int = 10_000  # documents a trained tokenizer learns from
    seed: int = 0  # document shuffle and the validation split's draw
    validation_fraction: float = 0.005  # documents held out for validation (module doc: the split)
    validation_min_docs: int = 16  # floor of the split, in documents
    validation_max_docs: int = 10_000  # cap of the split, in documents


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


def file_documents(url: str) -> Iterator[str]:
    """Yield the non-empty documents of one input file.

    Raises:
        DataError: a parquet file that does not read (corrupt, truncated) or has no `text` column,
            a jsonl line without a `text` string, or a compressed file that does not decompress.
    """
    with fsspec.open(url, "rb") as f:
        if url.endswith(".parquet"):
            try:
                batches = pq.ParquetFile(f).iter_batches(batch_size=READ_BATCH_DOCS, columns=["text"])
                for batch in batches:
                    yield from (t for t in batch.column(0).to_pylist() if t and t.strip())
            except (pa.ArrowException, OSError, KeyError, ValueError) as e:  # a corrupt page is an OSError
                raise DataError(
                    f"cannot read {url} as parquet with a 'text' column ({str(e).splitlines()[0]}); "
                    "re-write or remove it"
                ) from None
            return
        if not url.endswith((".jsonl", *(f".jsonl{s}" for s in COMPRESSION))):
            text = f.read().decode("utf-8", errors="replace")
            if text.strip():
                yield text
            return
        codec = COMPRESSION.get(os.path.splitext(url)[1])
        raw = io.BufferedReader(pa.CompressedInputStream(pa.PythonFile(f, mode="r"), codec)) if codec else f
        try:
            for n, line in enumerate(io.TextIOWrapper(raw, encoding="utf-8", errors="replace"), 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    raise DataError(f"{url} line {n} is not a JSON object with a 'text' field") from None
                if not isinstance(text, str):
                    raise DataError(f"{url} line {n}: 'text' is not a string")
                if text.strip():
                    yield text
        except OSError as e:
            raise DataError(f"{url} is not a valid {codec} file ({e}); re-download or remove it") from None


DocumentKey = tuple[int, str, int]  # (63-bit hash, file, index in the file): the validation draw's order


def document_key(seed: int, url: str, index: int) -> DocumentKey:
    """The key of the `index`-th non-empty document of `url` in the validation draw (module doc)."""
    digest = hashlib.blake2b(json.dumps([seed, url, index]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1, url, index


def read_documents(
    batch: dict[str, np.ndarray], seed: int, held_out: DocumentKey | None = None, validation: bool = False
) -> Iterator[dict[str, list[str]]]:
    """`map_batches` function (one row: `task`, `paths`): the documents of the task's files,
    interleaved by a seeded draw weighted by file size (module doc), in blocks of `READ_BATCH_DOCS`.
    With `held_out` (the largest held-out key), only the training split's documents (keys above
    it), or with `validation` only the held-out ones. Holds one open reader per file and one block."""
    (task,), (paths,) = batch["task"], batch["paths"]
    readers = [enumerate(file_documents(str(url))) for url in paths]
    urls = [str(url) for url in paths]
    sizes = [float(max(fsspec.core.url_to_fs(str(url))[0].size(str(url)) or 1, 1)) for url in paths]
    rng, docs = np.random.default_rng([seed, int(task)]), []
    while readers:
        k = int(rng.choice(len(readers), p=np.divide(sizes, sum(sizes))))
        index, doc = next(readers[k], (None, None))
        if doc is None:
            del readers[k], sizes[k], urls[k]
            continue
        assert index is not None  # a document always comes with its index
        if held_out is not None and (document_key(seed, urls[k], index) <= held_out) != validation:
            continue
        docs.append(doc)
        if len(docs) == READ_BATCH_DOCS:
            yield {"text": docs}
            docs = []
    if docs:
        yield {"text": docs}


def document_keys(batch: dict[str, np.ndarray], seed: int, keep: int) -> Iterator[dict[str, list]]:
    """`map_batches` function (one row: `task`, `paths`), the count pass of the validation draw:
    one row with the task's document count and its `keep` smallest keys (JSON)."""
    (paths,), counted = batch["paths"], [0]

    def keys() -> Iterator[DocumentKey]:
        for url in paths:
            for index, _ in enumerate(file_documents(str(url))):
                counted[0] += 1
                yield document_key(seed, str(url), index)

    smallest = heapq.nsmallest(keep, keys())
    yield {"documents": [counted[0]], "keys": [json.dumps(smallest)]}


def validation_size(documents: int, settings: PrepareSettings) -> int:
    """Documents held out of `documents`: the fraction, raised to the floor, cut to the cap and
    to half the corpus (the training split keeps at least half)."""
    wanted = max(round(settings.validation_fraction * documents), settings.validation_min_docs)
    return min(wanted, settings.validation_max_docs, documents // 2)


def load_tokenizer(path: str, eos_token: str | None) -> tuple[Tokenizer, str]:
    """A Hugging Face `tokenizer.json` and its EOS token.

    Raises:
        DataError: the file is missing or does not parse, or has no EOS token.
    """
    try:
        with fsspec.open(path, "r") as f:
            tok = Tokenizer.from_str(f.read())
    except FileNotFoundError:
        raise DataError(f"tokenizer file {path} does not exist") from None
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise DataError(f"cannot parse {path} as a Hugging Face tokenizer.json ({str(e).splitlines()[0]})") from None
    if eos_token is not None:
        if tok.token_to_id(eos_token) is None:
            raise DataError(f"--eos-token {eos_token!r} is not in the vocabulary of {path}")
        return tok, eos_token
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    for candidate in EOS_CANDIDATES:
        if candidate in special:
            return tok, candidate
    raise DataError(f"{path} has none of the EOS tokens {', '.join(EOS_CANDIDATES)}; name it with --eos-token")


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


@functools.lru_cache(maxsize=2)
def _tokenizer(text: str) -> Tokenizer:
    return Tokenizer.from_str(text)


def tokenize_and_pack(batch: dict[str, np.ndarray], tokenizer_json: str, eos_id: int, seq_len: int) -> dict:
    """`map_batches` function: documents -> rows of `seq_len + 1` int32 tokens, EOS after each document.

    Also returns the batch's `STATS` in the first row's `n_documents`, `n_tokens`, `n_dropped`
    columns (0 elsewhere); a batch too short for one row yields one row with null `tokens`.
    """
    encodings = _tokenizer(tokenizer_json).encode_batch(list(batch["text"]))
    stream = np.concatenate([np.append(np.asarray(e.ids, np.int32), np.int32(eos_id)) for e in encodings])
    n = len(stream) // (seq_len + 1)
    rows = max(n, 1)
    stats = {f"n_{k}": np.zeros(rows, np.int64) for k in STATS}
    for k, v in zip(STATS, (len(encodings), len(stream), len(stream) - n * (seq_len + 1)), strict=True):
        stats[f"n_{k}"][0] = v
    values = pa.array(stream[: n * (seq_len + 1)])
    tokens = (
        pa.FixedSizeListArray.from_arrays(values, seq_len + 1) if n else pa.nulls(1, pa.list_(pa.int32(), seq_len + 1))
    )
    return {"tokens": tokens, **stats}


def fingerprint(files: list[str], settings: PrepareSettings, tokenizer_json: str | None) -> str:
    """sha256 over the settings, the given tokenizer file's contents and each input's identity
    (path, size, mtime or ETag: see the module doc)."""
    h = hashlib.sha256(json.dumps(asdict(settings), sort_keys=True).encode())
    h.update(hashlib.sha256((tokenizer_json or "").encode()).digest())
    fs, _ = fsspec.core.url_to_fs(files[0])
    for url in files:
        info = fs.info(url)
        version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or ""
        h.update(json.dumps([url, info.get("size"), str(version)]).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class PrepareReport:
    """What `prepare` did: the manifest, whether the dataset was reused, and tokens/s (0 if reused)."""

    manifest: Manifest
    reused: bool
    tokens_per_s: float

    def line(self, output: str) -> str:
        m = self.manifest
        if self.reused:
            return f"reused {output}: {m.num_samples} samples x {m.seq_len + 1} tokens, vocab {m.vocab_size}"
        v = m.validation
        held_out = f"; validation: {v.documents} documents, {v.num_samples} samples" if v else "; no validation split"
        return (
            f"wrote {output}: {m.documents} documents, {m.tokens} tokens, {m.num_samples} samples x "
            f"{m.seq_len + 1} tokens in {len(m.shards)} shards, {m.dropped_tokens} tokens dropped "
            f"({m.dropped_tokens / max(m.tokens, 1):.2%}), {self.tokens_per_s:,.0f} tokens/s, vocab {m.vocab_size}"
            + held_out
        )
