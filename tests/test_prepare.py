import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from conftest import REPO, STDLIB_JSON
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.prepare import PrepareSettings, prepare
from raytrain_ft.errors import DataError


def test_samples_dense_unique_fixed_length(dataset):
    m = load_manifest(dataset)
    tables = [pq.read_table(os.path.join(dataset, s.file)) for s in m.shards]
    ids = np.concatenate([t.column("sample_id").to_numpy() for t in tables])
    assert np.array_equal(np.sort(ids), np.arange(m.num_samples))
    assert sum(len(t) for t in tables) == m.num_samples == sum(s.num_samples for s in m.shards)
    for t, s in zip(tables, m.shards, strict=True):
        assert t.column("tokens").type.list_size == m.seq_len + 1 == 33
        assert t.column("sample_id")[0].as_py() == s.first_sample_id
        assert pq.ParquetFile(os.path.join(dataset, s.file)).metadata.num_row_groups == len(s.row_group_rows)
    tokens = np.stack(tables[0].column("tokens").to_numpy(zero_copy_only=False))
    assert tokens.max() < m.vocab_size and (tokens == m.eos_token_id).any()


def test_rerun_reuses_and_new_settings_replace(tmp_path):
    out = str(tmp_path / "ds")
    first, reused = prepare(STDLIB_JSON, out, PrepareSettings(seq_len=32, vocab_size=300))
    assert not reused
    mtime = os.path.getmtime(os.path.join(out, "shard-00000.parquet"))
    again, reused = prepare(STDLIB_JSON, out, PrepareSettings(seq_len=32, vocab_size=300))
    assert reused and again == first and os.path.getmtime(os.path.join(out, "shard-00000.parquet")) == mtime
    other, reused = prepare(STDLIB_JSON, out, PrepareSettings(seq_len=16, vocab_size=300))
    assert not reused and other.seq_len == 16 and other.fingerprint != first.fingerprint
    with open(os.path.join(out, "manifest.json")) as f:
        assert json.load(f)["seq_len"] == 16
    assert sorted(os.listdir(out)) == ["manifest.json", "shard-00000.parquet", "tokenizer.json"]


def test_jsonl_and_parquet_inputs(tmp_path):
    import pyarrow as pa

    (tmp_path / "a.jsonl").write_text(
        "\n".join(json.dumps({"text": "def f(x):\n    return x * 2\n" * 20}) for _ in range(5))
    )
    pq.write_table(pa.table({"text": ["class A:\n    pass\n" * 30] * 4}), tmp_path / "b.parquet")
    m, _ = prepare(str(tmp_path), str(tmp_path / "out"), PrepareSettings(seq_len=16, vocab_size=300))
    # each reader contributed all of its documents: decode the packed stream (samples in id order)
    table = pa.concat_tables([pq.read_table(tmp_path / "out" / s.file) for s in m.shards]).sort_by("sample_id")
    stream = np.concatenate(table.column("tokens").to_numpy(zero_copy_only=False)).tolist()
    text = Tokenizer.from_file(str(tmp_path / "out" / m.tokenizer_file)).decode(stream)
    assert text.count("return x * 2") == 5 * 20  # a.jsonl: 5 documents
    assert text.count("class A:") >= 3 * 30  # b.parquet: 4 documents (the stream's cut tail may end inside the last)


def run_prepare(*args):
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "jobs", "prepare_data.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_no_matching_files_is_one_line_error(tmp_path):
    r = run_prepare("--input", str(tmp_path / "nothing" / "*.txt"), "--output", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: no input files match {tmp_path}/nothing/*.txt (supported: .txt, .md, .py, .jsonl, .parquet)"
    ]


def test_empty_documents_is_one_line_error(tmp_path):
    (tmp_path / "a.txt").write_text("   \n")
    r = run_prepare("--input", str(tmp_path / "*.txt"), "--output", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: all 1 input files")
    assert "Traceback" not in r.stderr  # progress-bar lines may precede the one error line


def test_unreadable_parquet_raises_data_error(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match="cannot read .*bad.parquet as parquet"):
        prepare(str(tmp_path / "*.parquet"), str(tmp_path / "o"), PrepareSettings(seq_len=16, vocab_size=300))


def test_output_folder_that_is_not_a_dataset_is_never_deleted(tmp_path):
    keep = tmp_path / "precious"
    keep.mkdir()
    (keep / "notes.txt").write_text("do not delete")
    with pytest.raises(DataError, match="exists and is not a prepared dataset"):
        prepare(STDLIB_JSON, str(keep), PrepareSettings(seq_len=16, vocab_size=300))
    assert (keep / "notes.txt").read_text() == "do not delete"
