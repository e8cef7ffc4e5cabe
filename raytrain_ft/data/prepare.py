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

from raytrain_ft.data.manifest import MANIFEST, Manifest, Shard, Split, load_manifest
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
VALIDATION_FOLDER = "validation"
WORKER_ERROR = re.compile(r"raytrain_ft\.errors\.\w+Error: (.*)")


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


def draw_validation(tasks: ray.data.Dataset, settings: PrepareSettings) -> list[DocumentKey]:
    """The held-out documents' keys, smallest first (module doc); [] without a split."""
    if settings.validation_max_docs == 0 or settings.validation_fraction == settings.validation_min_docs == 0:
        return []
    counts = tasks.map_batches(
        document_keys,  # type: ignore[arg-type]  # Ray's annotation has no room for fn_kwargs
        batch_size=1,
        num_cpus=IO_CPUS,
        fn_kwargs={"seed": settings.seed, "keep": settings.validation_max_docs},
    )
    total = 0

    def keys() -> Iterator[DocumentKey]:
        nonlocal total
        for row in counts.iter_rows():
            total += row["documents"]
            yield from (tuple(k) for k in json.loads(row["keys"]))

    smallest = heapq.nsmallest(settings.validation_max_docs, keys())
    return smallest[: validation_size(total, settings)]


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
        v = m.validation
        held_out = f"; validation: {v.documents} documents, {v.num_samples} samples" if v else "; no validation split"
        return (
            f"wrote {output}: {m.documents} documents, {m.tokens} tokens, {m.num_samples} samples x "
            f"{m.seq_len + 1} tokens in {len(m.shards)} shards, {m.dropped_tokens} tokens dropped "
            f"({m.dropped_tokens / max(m.tokens, 1):.2%}), {self.tokens_per_s:,.0f} tokens/s, vocab {m.vocab_size}"
            + held_out
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
    if not (
        0 <= settings.validation_fraction <= 0.5 and 0 <= settings.validation_min_docs <= settings.validation_max_docs
    ):
        raise DataError(
            f"need 0 <= --validation-fraction <= 0.5 and 0 <= --validation-min-docs <= --validation-max-docs, got "
            f"{settings.validation_fraction}, {settings.validation_min_docs}, {settings.validation_max_docs}"
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


def _read_tasks(groups: list[list[str]]) -> ray.data.Dataset:
    return ray.data.from_items([{"task": i, "paths": g} for i, g in enumerate(groups)], override_num_blocks=len(groups))


def _pack(docs: ray.data.Dataset, tok: Tokenizer, eos: str, settings: PrepareSettings, folder: str) -> list[dict]:
    """Tokenize, pack and write `docs` as shards in `folder`; the shards' stats (`ShardSink.write`)."""
    sink = ShardSink(folder, settings.rows_per_row_group)
    rows = docs.map_batches(
        tokenize_and_pack,  # type: ignore[arg-type]  # Ray's annotation has no room for fn_kwargs
        batch_size=PACK_BATCH_DOCS,
        fn_kwargs={"tokenizer_json": tok.to_str(), "eos_id": tok.token_to_id(eos), "seq_len": settings.seq_len},
    )
    rows.write_datasink(sink, ray_remote_args={"num_cpus": IO_CPUS})
    return sink.results


def _shards(results: list[dict]) -> tuple[list[Shard], dict[str, int]]:
    """The written shards with their first sample ids (in file order), and the summed `STATS`."""
    shards, first = [], 0
    for r in sorted((r for r in results if r["num_samples"]), key=lambda r: r["file"]):
        shards.append(Shard(r["file"], first, r["num_samples"], r["row_group_rows"]))
        first += r["num_samples"]
    return shards, {k: sum(r[k] for r in results) for k in STATS}


def _run(files, pattern, output, fs, out, settings, given, fp, started) -> PrepareReport:
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # with the seeded interleave: the same input, the same shards
    ctx.log_internal_stack_trace = False
    try:
        shuffled = [files[i] for i in np.random.default_rng(settings.seed).permutation(len(files))]
        groups = [shuffled[i : i + FILES_PER_READ_TASK] for i in range(0, len(shuffled), FILES_PER_READ_TASK)]
        tasks = _read_tasks(groups)
        held_out = draw_validation(tasks, settings)
        split = {"seed": settings.seed, "held_out": held_out[-1] if held_out else None}
        # Ray's annotation of a batch function has no room for its fn_kwargs parameters
        docs = tasks.map_batches(read_documents, batch_size=1, num_cpus=IO_CPUS, fn_kwargs=split)  # type: ignore[arg-type]
        if given:
            tok, eos = given
        else:
            sample = [r["text"] for r in docs.limit(settings.tokenizer_sample_docs).take_all()]  # streams, stops early
            if not sample:
                raise DataError(f"all {len(files)} input files matching {pattern} are empty")
            tok, eos = train_tokenizer(sample, settings.vocab_size), EOS
        fs.pipe_file(f"{out}/{TOKENIZER_FILE}", tok.to_str().encode())
        results = _pack(docs, tok, eos, settings, output.rstrip("/"))
        validation_results = []
        if held_out:  # only the files holding held-out documents, in the same order
            holding = {url for _, url, _ in held_out}
            kept = [f for f in shuffled if f in holding]
            val_tasks = _read_tasks(
                [kept[i : i + FILES_PER_READ_TASK] for i in range(0, len(kept), FILES_PER_READ_TASK)]
            )
            val_docs = val_tasks.map_batches(
                read_documents,  # type: ignore[arg-type]  # Ray's annotation has no room for fn_kwargs
                batch_size=1,
                num_cpus=IO_CPUS,
                fn_kwargs={**split, "validation": True},
            )
            validation_results = _pack(val_docs, tok, eos, settings, f"{output.rstrip('/')}/{VALIDATION_FOLDER}")
    except Exception as e:  # a DataError raised in a Ray task reaches us as text inside Ray's error
        if isinstance(e, DataError) and not isinstance(e, ray.exceptions.RayError):
            raise
        match = WORKER_ERROR.search(str(e))
        if match is None:
            raise
        raise DataError(match.group(1)) from None
    shards, totals = _shards(results)
    if totals["documents"] == 0:
        fs.rm(out, recursive=True)
        raise DataError(f"all {len(files)} input files matching {pattern} are empty")
    if not shards:
        fs.rm(out, recursive=True)
        raise DataError(f"the corpus has fewer than {settings.seq_len + 1} tokens; lower --seq-len or add text")
    validation = None
    if held_out:
        val_shards, val_totals = _shards(validation_results)
        validation = Split(
            folder=VALIDATION_FOLDER,
            num_samples=sum(s.num_samples for s in val_shards),
            shards=val_shards,
            documents=val_totals["documents"],
            tokens=val_totals["tokens"],
            dropped_tokens=val_totals["dropped"],
        )
    manifest = Manifest(
        num_samples=sum(s.num_samples for s in shards),
        seq_len=settings.seq_len,
        vocab_size=tok.get_vocab_size(),
        eos_token_id=tok.token_to_id(eos),
        tokenizer_file=TOKENIZER_FILE,
        fingerprint=fp,
        shards=shards,
        documents=totals["documents"],
        tokens=totals["tokens"],
        dropped_tokens=totals["dropped"],
        validation=validation,
    )
    fs.pipe_file(f"{out}/{MANIFEST}", manifest.to_json().encode())  # written last: it marks the dataset complete
    fs.rm(f"{out}/{MARKER}")
    tokens = totals["tokens"] + (validation.tokens if validation else 0)
    return PrepareReport(manifest, False, tokens / (time.perf_counter() - started))
