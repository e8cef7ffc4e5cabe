"""Preparation on Ray Data: inputs, a given tokenizer, local and S3 output, bad inputs (one line, exit 2)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
from test_remote_storage import s3_env  # noqa: F401  (fixture: the local S3 server)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import REPO, STDLIB_JSON
from raytrain_ft.core.errors import DataError
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.prepare import PrepareSettings, read_documents
from raytrain_ft.launch.prepare import prepare

pytestmark = pytest.mark.usefixtures("ray_local")


def doc(i: int) -> str:
    return f"def function_{i}(x):\n    return x * {i} + {i * 7}\n" * (3 + i % 5)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str, list[str]]:
    """Two jsonl.gz files, one parquet file, and a tokenizer.json whose EOS is `</s>`."""
    root = tmp_path_factory.mktemp("corpus")
    docs = [doc(i) for i in range(60)]
    for k, part in enumerate((docs[:25], docs[25:45])):
        with gzip.open(root / f"part-{k}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(part))
    pq.write_table(pa.table({"text": docs[45:]}), root / "part-2.parquet")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        docs, trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], initial_alphabet=alphabet)
    )
    tokenizer = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tok.save(tokenizer)
    return str(root), tokenizer, docs


def check_dataset(url: str, tokenizer: str, docs: list[str]) -> None:
    """Both splits (the default holds out 16 of the 60 documents): every document once, exact counts."""
    m = load_manifest(url)
    given = Tokenizer.from_file(tokenizer)
    eos = given.token_to_id("</s>")
    assert (m.vocab_size, m.eos_token_id, m.seq_len) == (given.get_vocab_size(), eos, 16)
    v = m.validation
    assert v.documents == 16 and m.documents + v.documents == len(docs)
    assert m.tokens + v.tokens == sum(len(given.encode(d).ids) + 1 for d in docs)  # each document + its EOS
    fs, base = fsspec.core.url_to_fs(url)
    with fs.open(f"{base}/{m.tokenizer_file}", "r") as f:
        saved = Tokenizer.from_str(f.read())
    text = "def round_trip(y):\n    return y\n"
    assert saved.decode(saved.encode(text).ids) == text
    for folder, split in ((base, m), (f"{base}/{v.folder}", v)):
        assert split.dropped_tokens == split.tokens - split.num_samples * 17 and 0 <= split.dropped_tokens < 17 * 2
        rows = []
        for s in split.shards:
            with fs.open(f"{folder}/{s.file}", "rb") as f:
                table = pq.read_table(f)
            assert len(table) == s.num_samples == sum(s.row_group_rows)
            rows.append(np.stack(table.column("tokens").to_numpy(zero_copy_only=False)))
        assert sum(len(r) for r in rows) == split.num_samples
        stream = np.concatenate([r.reshape(-1) for r in rows]).tolist()
        cuts = [i for i, t in enumerate(stream) if t == eos]
        pieces = [saved.decode(stream[a + 1 : b]) for a, b in zip(cuts, cuts[1:], strict=False)]
        assert len(pieces) >= split.documents // 2 and all(p in docs for p in pieces)  # EOS between whole documents


def test_given_tokenizer_jsonl_gz_and_parquet_to_a_local_folder(tmp_path, corpus):
    root, tokenizer, docs = corpus
    out = tmp_path / "out"
    out.mkdir()  # what a crashed run leaves: its marker and a partial shard
    (out / "PREPARING").write_text("another fingerprint")
    (out / "shard-000007.parquet").write_bytes(b"partial")
    settings = PrepareSettings(seq_len=16, tokenizer=tokenizer, rows_per_row_group=8)
    report = prepare(root, str(out), settings)
    assert not report.reused
    check_dataset(str(out), tokenizer, docs)
    assert "PREPARING" not in os.listdir(out) and "shard-000007.parquet" not in os.listdir(out)
    files = {s.file for s in report.manifest.shards} | {"manifest.json", "tokenizer.json", "validation"}
    assert files == set(os.listdir(out))
    mtime = os.path.getmtime(out / "manifest.json")
    again = prepare(root, str(out), settings)
    assert again.reused and again.manifest == report.manifest and os.path.getmtime(out / "manifest.json") == mtime
    other = prepare(root, str(out), PrepareSettings(seq_len=8, tokenizer=tokenizer, rows_per_row_group=8))
    assert not other.reused and other.manifest.fingerprint != report.manifest.fingerprint
    assert load_manifest(str(out)).seq_len == 8


def test_jsonl_zst_and_plain_jsonl_inputs(tmp_path, corpus):
    _, tokenizer, docs = corpus
    src = tmp_path / "in"
    src.mkdir()
    with pa.CompressedOutputStream(str(src / "a.jsonl.zst"), "zstd") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in docs[:30]).encode())
    (src / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[30:]))
    prepare(str(src), str(tmp_path / "out"), PrepareSettings(seq_len=16, tokenizer=tokenizer, rows_per_row_group=8))
    check_dataset(str(tmp_path / "out"), tokenizer, docs)  # 60 documents, their exact token count


def test_a_read_task_interleaves_its_files_in_a_seeded_order(tmp_path):
    paths = []
    for f in range(3):
        paths.append(str(tmp_path / f"f{f}.jsonl"))
        (tmp_path / f"f{f}.jsonl").write_text("".join(json.dumps({"text": f"{f} {i}"}) + "\n" for i in range(100)))
    blocks = [b["text"] for b in read_documents({"task": [0], "paths": [paths]}, seed=0)]
    docs = [d for b in blocks for d in b]
    assert [len(b) for b in blocks] == [64] * 4 + [44]
    for f in range(3):  # every document once, each file's in its own order
        assert [d for d in docs if d.startswith(f"{f} ")] == [f"{f} {i}" for i in range(100)]
    assert all(sum(d.startswith(f"{f} ") for d in blocks[0]) >= 10 for f in range(3))  # the first block mixes all
    assert all(len({d[0] for d in b}) >= 2 for b in blocks)  # equal sizes: the files run out together
    again = [b["text"] for b in read_documents({"task": [0], "paths": [paths]}, seed=0)]
    other = [b["text"] for b in read_documents({"task": [0], "paths": [paths]}, seed=1)]
    assert again == blocks and other != blocks


def test_samples_dense_fixed_length_with_eos(dataset):
    m = load_manifest(dataset)
    assert m.shards[0].first_sample_id == 0
    assert [s.first_sample_id for s in m.shards[1:]] == list(np.cumsum([s.num_samples for s in m.shards])[:-1])
    tables = [pq.read_table(os.path.join(dataset, s.file)) for s in m.shards]
    assert sum(len(t) for t in tables) == m.num_samples == sum(s.num_samples for s in m.shards) == 599
    for t, s in zip(tables, m.shards, strict=True):
        assert t.column_names == ["tokens"] and t.column("tokens").type.list_size == m.seq_len + 1 == 33
        assert pq.ParquetFile(os.path.join(dataset, s.file)).metadata.num_row_groups == len(s.row_group_rows)
    tokens = np.stack(tables[0].column("tokens").to_numpy(zero_copy_only=False))
    assert tokens.max() < m.vocab_size and (tokens == m.eos_token_id).any()
    assert m.dropped_tokens / m.tokens <= 0.01


def test_given_tokenizer_to_s3(corpus, s3_env):  # noqa: F811
    root, tokenizer, docs = corpus
    settings = PrepareSettings(seq_len=16, tokenizer=tokenizer, rows_per_row_group=8)
    # Ray's workers started before the S3 server: this prepare runs in a task carrying its environment
    remote = ray.remote(prepare).options(runtime_env={"env_vars": s3_env}, num_cpus=0)
    report = ray.get(remote.remote(root, "s3://rtft/data/given", settings))
    assert not report.reused
    check_dataset("s3://rtft/data/given", tokenizer, docs)


def run_prepare(*args):
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "jobs", "prepare_data.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_line_error(tmp_path, files: dict[str, bytes], *extra: str) -> str:
    """Prepare a corpus of `files` with the CLI; return its one error line (exit status 2, no dataset)."""
    src = tmp_path / "in"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    out = tmp_path / "out"
    r = run_prepare("--input", str(src), "--output", str(out), "--seq-len", "16", "--vocab-size", "300", *extra)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert not (out / "manifest.json").exists()
    return r.stderr.strip().splitlines()[-1]


def test_no_matching_files_is_one_line_error(tmp_path):
    r = run_prepare("--input", str(tmp_path / "nothing" / "*.txt"), "--output", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: no input files match {tmp_path}/nothing/*.txt "
        "(supported: .txt, .md, .py, .jsonl, .jsonl.gz, .jsonl.zst, .parquet)"
    ]


def test_a_jsonl_line_without_text_is_one_line_and_exit_2(tmp_path):
    lines = json.dumps({"text": doc(1)}) + "\n" + json.dumps({"body": "no text"}) + "\n"
    line = one_line_error(tmp_path, {"a.jsonl.gz": gzip.compress(lines.encode())})
    assert line == f"error: {tmp_path}/in/a.jsonl.gz line 2 is not a JSON object with a 'text' field"


def parquet_bytes(corruption: str) -> bytes:
    """A snappy parquet file of 200 documents, truncated (a partial download) or with flipped data bytes."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": [doc(i) for i in range(200)]}), sink, compression="snappy")
    data = sink.getvalue().to_pybytes()
    if corruption == "truncated":
        return data[: len(data) // 2]
    return data[:200] + bytes(b ^ 0xFF for b in data[200:1200]) + data[1200:]  # footer intact, pages not


@pytest.mark.parametrize(
    "files, tokenizer, message",
    [
        ({"a.jsonl.gz": b"\x1f\x8b\x08\x00 definitely not gzip"}, None, r"a.jsonl.gz is not a valid gzip file"),
        (
            {"a.txt": doc(1).encode(), "b.parquet": parquet_bytes("truncated")},
            None,
            r"^cannot read \S+/in/b.parquet as parquet with a 'text' column \(Parquet magic bytes not found",
        ),
        (
            {"a.txt": doc(1).encode(), "b.parquet": parquet_bytes("flipped")},
            None,
            r"^cannot read \S+/in/b.parquet as parquet with a 'text' column \(Corrupt snappy compressed data",
        ),
        ({"a.txt": doc(1).encode()}, b"{not json", r"cannot parse .*tokenizer.json as a Hugging Face tokenizer.json"),
        ({"a.txt": b"   \n", "b.jsonl": b""}, None, r"all 2 input files matching .* are empty"),
    ],
    ids=["corrupt-gz", "truncated-parquet", "corrupt-parquet-page", "bad-tokenizer", "empty-corpus"],
)
def test_bad_input_is_a_data_error_and_leaves_no_dataset(tmp_path, files, tokenizer, message):
    src = tmp_path / "in"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    if tokenizer is not None:
        (tmp_path / "tokenizer.json").write_bytes(tokenizer)
    settings = PrepareSettings(
        seq_len=16, vocab_size=300, tokenizer=str(tmp_path / "tokenizer.json") if tokenizer else None
    )
    with pytest.raises(DataError, match=message) as error:
        prepare(str(src), str(tmp_path / "out"), settings)
    assert len(str(error.value).splitlines()) == 1
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_output_folder_that_is_not_a_dataset_is_never_deleted(tmp_path):
    keep = tmp_path / "precious"
    keep.mkdir()
    (keep / "notes.txt").write_text("do not delete")
    with pytest.raises(DataError, match="exists and is not a prepared dataset"):
        prepare(STDLIB_JSON, str(keep), PrepareSettings(seq_len=16, vocab_size=300))
    assert (keep / "notes.txt").read_text() == "do not delete"
