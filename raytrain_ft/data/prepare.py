"""Turn a text corpus into packed, fixed-length token sequences on Ray Data (parquet shards + manifest).

Input: an fsspec path, folder or glob of `.txt`, `.md`, `.py` (one document per file), `.jsonl`,
`.jsonl.gz`, `.jsonl.zst` (one document per line, field `text`) or `.parquet` (column `text`)
files. Default: the running Python's standard library sources, so the demo needs no download.

The pipeline streams end to end (no operator waits for the whole read); the driver holds the
file list, a bounded tokenizer sample and one stats row per shard, never the corpus:

1. the files, in a seeded random order, are cut into groups of `FILES_PER_READ_TASK`, one read
   task each;
2. a read task opens its files together and interleaves their documents: each next document comes
   from a file drawn with `numpy.random.default_rng([seed, task])`, with probability proportional
   to the file's size among those not yet exhausted (so the files run out at about the same time),
   and yields blocks of `READ_BATCH_DOCS` documents. A block, hence a packed batch and a row group,
   mixes up to `FILES_PER_READ_TASK` files. This is the document shuffle: local to a window of
   files, never corpus-wide, because a corpus-wide shuffle (`random_shuffle`, or even
   `randomize_block_order`, an all-to-all operator) must hold every block of the corpus before it
   emits the first, in the object store and then on spill disk. The loader's per-epoch permutation
   of row groups (`raytrain_ft.data.order`) mixes across the whole corpus at training time;
3. `map_batches` tokenizes `PACK_BATCH_DOCS` documents at a time, appends the EOS token after each
   document and cuts the batch's token stream into rows of `seq_len + 1` tokens; the batch's last
   partial row is dropped (counted in the manifest's `dropped_tokens`);
4. `ShardSink` writes each write task's rows as one parquet shard (row groups of
   `rows_per_row_group`), and the driver writes the manifest last from the shards' stats. Sample
   ids are the rows' positions in manifest order (`Shard.first_sample_id`).

Tokenizer: a given Hugging Face `tokenizer.json` (EOS from `eos_token` or the first of
`EOS_CANDIDATES` among its special tokens), or a byte-level BPE trained on the first
`tokenizer_sample_docs` documents in the interleaved order (streamed: the read stops there).
Either way it is saved as `tokenizer.json` next to the shards, and the vocabulary size is the
tokenizer's.

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
import io
import json
import os
import re
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data import Datasink
from ray.data.datasource import WriteResult
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from raytrain_ft.data.manifest import MANIFEST, Manifest, Shard, load_manifest
from raytrain_ft.errors import DataError

EOS = "<|endoftext|>"  # the EOS of a trained tokenizer
EOS_CANDIDATES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
TOKENIZER_FILE = "tokenizer.json"
MARKER = "PREPARING"
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
COMPRESSION = {".gz": "gzip", ".zst": "zstd"}
READ_BATCH_DOCS = 64  # documents per block out of a read task (and per parquet read)
FILES_PER_READ_TASK = 16  # files one read task interleaves: the window of the document shuffle
# Read and write tasks' CPUs. Unlike the tokenize tasks' 1, so Ray Data fuses neither into the
# tokenize tasks: fused with the read, tokenizing ran in the files / 16 read tasks; fused with the
# write, each tokenize task took SAMPLES_PER_SHARD *documents* (the fused operator bundles the larger
# of the two input minimums), so a small corpus was one task and a task's memory grew with it.
# Reading (decompress, parse JSON) and writing (parquet encode) are the lighter parts.
IO_CPUS = 0.5
PACK_BATCH_DOCS = 256  # documents tokenized and packed together: the dropped tail is < 1 row per batch
SAMPLES_PER_SHARD = 8192  # rows a write task gathers before writing its shard
STATS = ("documents", "tokens", "dropped")  # counted per packed batch, summed per shard
WORKER_ERROR = re.compile(r"raytrain_ft\.errors\.\w+Error: (.*)")


@dataclass(frozen=True)
class PrepareSettings:
    seq_len: int = 256
    vocab_size: int = 8192  # of a trained tokenizer; a given one brings its own
    rows_per_row_group: int = 512  # the unit the loader reads; see raytrain_ft.data.order for smaller ones
    tokenizer: str | None = None  # path or URL of a Hugging Face tokenizer.json; None = train one
    eos_token: str | None = None  # with `tokenizer`: its EOS token (default: found among its special tokens)
    tokenizer_sample_docs: int = 10_000  # documents a trained tokenizer learns from
    seed: int = 0  # document shuffle


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


def read_documents(batch: dict[str, np.ndarray], seed: int) -> Iterator[dict[str, list[str]]]:
    """`map_batches` function (one row: `task`, `paths`): the documents of the task's files,
    interleaved by a seeded draw weighted by file size (module doc), in blocks of `READ_BATCH_DOCS`.
    Holds one open reader per file and one block."""
    (task,), (paths,) = batch["task"], batch["paths"]
    readers = [file_documents(str(url)) for url in paths]
    sizes = [float(max(fsspec.core.url_to_fs(str(url))[0].size(str(url)) or 1, 1)) for url in paths]
    rng, docs = np.random.default_rng([seed, int(task)]), []
    while readers:
        k = int(rng.choice(len(readers), p=np.divide(sizes, sum(sizes))))
        doc = next(readers[k], None)
        if doc is None:
            del readers[k], sizes[k]
            continue
        docs.append(doc)
        if len(docs) == READ_BATCH_DOCS:
            yield {"text": docs}
            docs = []
    if docs:
        yield {"text": docs}


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


class ShardSink(Datasink[dict]):
    """Writes each write task's rows as one parquet shard of `tokens`; returns its stats."""

    def __init__(self, out: str, rows_per_row_group: int):
        self.out, self.rows_per_row_group = out, rows_per_row_group

    @property
    def min_rows_per_write(self) -> int:
        return SAMPLES_PER_SHARD

    def write(self, blocks, ctx) -> dict:
        table = pa.concat_tables([pa.Table.from_batches([b]) if isinstance(b, pa.RecordBatch) else b for b in blocks])
        stats = {k: int(pc.sum(table.column(f"n_{k}")).as_py() or 0) for k in STATS}
        table = table.select(["tokens"]).filter(table.column("tokens").is_valid())
        name = f"shard-{ctx.task_idx:06d}.parquet"
        groups = [min(self.rows_per_row_group, len(table) - g) for g in range(0, len(table), self.rows_per_row_group)]
        if len(table):
            with fsspec.open(f"{self.out}/{name}", "wb") as f:
                pq.write_table(table, f, row_group_size=self.rows_per_row_group)
        return {"file": name, "num_samples": len(table), "row_group_rows": groups, **stats}

    def on_write_complete(self, write_result: WriteResult[dict]) -> None:
        self.results = write_result.write_returns


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
        return (
            f"wrote {output}: {m.documents} documents, {m.tokens} tokens, {m.num_samples} samples x "
            f"{m.seq_len + 1} tokens in {len(m.shards)} shards, {m.dropped_tokens} tokens dropped "
            f"({m.dropped_tokens / max(m.tokens, 1):.2%}), {self.tokens_per_s:,.0f} tokens/s, vocab {m.vocab_size}"
        )


def _claim_output(fs, out: str, output: str, fp: str) -> Manifest | None:
    """The reusable dataset at `out`, or None after making `out` an empty folder marked as ours."""
    if fs.exists(f"{out}/{MANIFEST}") or fs.exists(f"{out}/{MARKER}"):
        try:
            existing = load_manifest(output)
            if existing.fingerprint == fp and not fs.exists(f"{out}/{MARKER}"):
                return existing
        except DataError:
            pass
        fs.rm(out, recursive=True)  # the manifest goes first: a half-deleted folder is never a dataset
    elif fs.exists(out) and fs.ls(out):
        raise DataError(f"{output} exists and is not a prepared dataset; choose another --output")
    fs.makedirs(out, exist_ok=True)
    fs.pipe_file(f"{out}/{MARKER}", fp.encode())
    return None


def prepare(input_pattern: str | None, output: str, settings: PrepareSettings) -> PrepareReport:
    """Prepare the dataset at `output` with Ray Data (started locally if Ray is not running).

    Raises:
        DataError: no input files, no non-empty document, unreadable input or tokenizer, a corpus
            too small for one sequence, or an output folder holding something else.
    """
    if settings.seq_len < 1 or settings.vocab_size < 257 or settings.rows_per_row_group < 1:
        raise DataError(
            f"need --seq-len >= 1, --vocab-size >= 257 (the byte alphabet + EOS) and --rows-per-row-group >= 1, "
            f"got {settings}"
        )
    files = list_inputs(input_pattern or default_corpus())
    given = load_tokenizer(settings.tokenizer, settings.eos_token) if settings.tokenizer else None
    fp = fingerprint(files, settings, given[0].to_str() if given else None)
    fs, out = fsspec.core.url_to_fs(output)
    out = out.rstrip("/")
    existing = _claim_output(fs, out, output, fp)
    if existing is not None:
        return PrepareReport(existing, True, 0.0)
    started, own_ray = time.perf_counter(), not ray.is_initialized()
    if own_ray:  # the cluster in RAY_ADDRESS (`ray job submit`), else a new local instance
        ray.init(address=None if os.environ.get("RAY_ADDRESS") else "local", include_dashboard=False)
    try:
        return _run(files, input_pattern or default_corpus(), output, fs, out, settings, given, fp, started)
    finally:
        if own_ray:
            ray.shutdown()


def _run(files, pattern, output, fs, out, settings, given, fp, started) -> PrepareReport:
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # with the seeded interleave: the same input, the same shards
    ctx.log_internal_stack_trace = False
    try:
        shuffled = [files[i] for i in np.random.default_rng(settings.seed).permutation(len(files))]
        groups = [shuffled[i : i + FILES_PER_READ_TASK] for i in range(0, len(shuffled), FILES_PER_READ_TASK)]
        tasks = ray.data.from_items(
            [{"task": i, "paths": g} for i, g in enumerate(groups)], override_num_blocks=len(groups)
        )
        # Ray's annotation of a batch function has no room for its `fn_kwargs` parameters
        docs = tasks.map_batches(read_documents, batch_size=1, num_cpus=IO_CPUS, fn_kwargs={"seed": settings.seed})  # type: ignore[arg-type]
        if given:
            tok, eos = given
        else:
            sample = [r["text"] for r in docs.limit(settings.tokenizer_sample_docs).take_all()]  # streams, stops early
            if not sample:
                raise DataError(f"all {len(files)} input files matching {pattern} are empty")
            tok, eos = train_tokenizer(sample, settings.vocab_size), EOS
        fs.pipe_file(f"{out}/{TOKENIZER_FILE}", tok.to_str().encode())
        sink = ShardSink(output.rstrip("/"), settings.rows_per_row_group)
        rows = docs.map_batches(
            tokenize_and_pack,  # type: ignore[arg-type]
            batch_size=PACK_BATCH_DOCS,
            fn_kwargs={"tokenizer_json": tok.to_str(), "eos_id": tok.token_to_id(eos), "seq_len": settings.seq_len},
        )
        rows.write_datasink(sink, ray_remote_args={"num_cpus": IO_CPUS})
    except Exception as e:  # a DataError raised in a Ray task reaches us as text inside Ray's error
        if isinstance(e, DataError) and not isinstance(e, ray.exceptions.RayError):
            raise
        match = WORKER_ERROR.search(str(e))
        if match is None:
            raise
        raise DataError(match.group(1)) from None
    results = sorted((r for r in sink.results if r["num_samples"]), key=lambda r: r["file"])
    totals = {k: sum(r[k] for r in sink.results) for k in STATS}
    if totals["documents"] == 0:
        fs.rm(out, recursive=True)
        raise DataError(f"all {len(files)} input files matching {pattern} are empty")
    if not results:
        fs.rm(out, recursive=True)
        raise DataError(f"the corpus has fewer than {settings.seq_len + 1} tokens; lower --seq-len or add text")
    shards, first = [], 0
    for r in results:
        shards.append(Shard(r["file"], first, r["num_samples"], r["row_group_rows"]))
        first += r["num_samples"]
    manifest = Manifest(
        num_samples=first,
        seq_len=settings.seq_len,
        vocab_size=tok.get_vocab_size(),
        eos_token_id=tok.token_to_id(eos),
        tokenizer_file=TOKENIZER_FILE,
        fingerprint=fp,
        shards=shards,
        documents=totals["documents"],
        tokens=totals["tokens"],
        dropped_tokens=totals["dropped"],
    )
    fs.pipe_file(f"{out}/{MANIFEST}", manifest.to_json().encode())  # written last: it marks the dataset complete
    fs.rm(f"{out}/{MARKER}")
    return PrepareReport(manifest, False, totals["tokens"] / (time.perf_counter() - started))
