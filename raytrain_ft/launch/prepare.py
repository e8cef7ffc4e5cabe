"""Prepare a dataset on Ray Data: `prepare(input, output, settings)` (`jobs/prepare_data.py`).

The rules (inputs, documents, the validation split, the tokenizer, packing, the fingerprint) are
`raytrain_ft.data.prepare`'s, Ray-free; this module runs them as one streaming pipeline.

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
"""

from __future__ import annotations

import heapq
import json
import re
import time
from collections.abc import Iterator

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data import Datasink
from ray.data.datasource import WriteResult
from tokenizers import Tokenizer

from raytrain_ft.core.errors import DataError
from raytrain_ft.data.manifest import MANIFEST, Manifest, Shard, Split, load_manifest
from raytrain_ft.data.prepare import (
    EOS,
    MARKER,
    STATS,
    TOKENIZER_FILE,
    VALIDATION_FOLDER,
    DocumentKey,
    PrepareReport,
    PrepareSettings,
    default_corpus,
    document_keys,
    fingerprint,
    list_inputs,
    load_tokenizer,
    read_documents,
    tokenize_and_pack,
    train_tokenizer,
    validation_size,
)
from raytrain_ft.launch import ray_start

FILES_PER_READ_TASK = 16  # files one read task interleaves: the window of the document shuffle
# Read and write tasks' CPUs. Unlike the tokenize tasks' 1, so Ray Data fuses neither into the
# tokenize tasks: fused with the read, tokenizing ran in the files / 16 read tasks; fused with the
# write, each tokenize task took SAMPLES_PER_SHARD *documents* (the fused operator bundles the larger
# of the two input minimums), so a small corpus was one task and a task's memory grew with it.
# Reading (decompress, parse JSON) and writing (parquet encode) are the lighter parts.
IO_CPUS = 0.5
PACK_BATCH_DOCS = 256  # documents tokenized and packed together: the dropped tail is < 1 row per batch
SAMPLES_PER_SHARD = 8192  # rows a write task gathers before writing its shard
WORKER_ERROR = re.compile(r"raytrain_ft\.core\.errors\.\w+Error: (.*)")


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
        ray_start.start()
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
