"""Held-out validation end to end: the split by document (Ray Data), and val_loss across a kill
and resume (2 gloo ranks on the Ray-free session of `tests/local_run.py`, tiny Llama, SQLite MLflow)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from tokenizers import Tokenizer

from conftest import STDLIB_JSON, assert_resumed, make_config, metric_by_step
from local_run import local_run
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.prepare import PrepareSettings, validation_size
from raytrain_ft.launch.prepare import prepare

pytestmark = pytest.mark.usefixtures("ray_local")  # `prepare` runs on Ray Data
VALIDATED = [3, 6, 9, 12, 15, 18]  # validation.interval_steps=3 over 20 steps


def split_ids(folder: str, manifest_shards, tokenizer: Tokenizer) -> set[int]:
    """The document ids (`<id>` markers in the text) found in a split's decoded rows."""
    ids = set()
    for s in manifest_shards:
        for row in pq.read_table(f"{folder}/{s.file}").column("tokens").to_pylist():
            ids |= {int(i) for i in re.findall(r"<(\d+)>", tokenizer.decode(row))}
    return ids


def test_the_two_splits_hold_disjoint_documents_that_together_are_the_corpus(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    docs = {i: f"<{i}> " * 40 for i in range(60)}  # each document far longer than a row: in some row whole
    for k, part in enumerate((range(0, 25), range(25, 50))):
        (src / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": docs[i]}) + "\n" for i in part))
    for i in range(50, 60):
        (src / f"doc-{i}.txt").write_text(docs[i])
    settings = PrepareSettings(
        seq_len=16, vocab_size=300, rows_per_row_group=4, validation_fraction=0.2, validation_min_docs=1
    )
    out = tmp_path / "out"
    m = prepare(str(src), str(out), settings).manifest
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    train = split_ids(str(out), m.shards, tok)
    held_out = split_ids(str(out / "validation"), m.validation.shards, tok)
    assert validation_size(60, settings) == 12 == m.validation.documents and m.documents == 48
    assert len(held_out) == 12 and not train & held_out and train | held_out == set(docs)
    assert m.validation.num_samples > 0 and m.validation.tokens + m.tokens == sum(
        len(tok.encode(d).ids) + 1 for d in docs.values()
    )
    again = prepare(str(src), str(tmp_path / "again"), settings).manifest  # a re-run draws the same documents
    assert split_ids(str(tmp_path / "again" / "validation"), again.validation.shards, tok) == held_out
    assert again.fingerprint == m.fingerprint
    other = PrepareSettings(**{**settings.__dict__, "validation_fraction": 0.1})
    assert prepare(str(src), str(tmp_path / "other"), other).manifest.fingerprint != m.fingerprint


@pytest.fixture(scope="module")
def split_dataset(tmp_path_factory) -> str:
    """The stdlib `json` package with one of its 5 documents held out."""
    out = str(tmp_path_factory.mktemp("data") / "split")
    prepare(STDLIB_JSON, out, PrepareSettings(seq_len=32, vocab_size=512, rows_per_row_group=2, validation_min_docs=1))
    return out


def validated_run(tmp_path, dataset: str, *more: str):
    cfg = make_config(
        tmp_path, dataset, "train.max_steps=20", "validation.interval_steps=3", "validation.num_batches=2", *more
    )
    return cfg, local_run(cfg)


def test_val_loss_after_a_kill_and_resume_equals_the_uninterrupted_runs(tmp_path, split_dataset):
    m = load_manifest(split_dataset)
    assert m.validation.documents == 1 and m.validation.num_samples >= 16  # 2 global batches of 8
    ref_cfg, ref_run = validated_run(tmp_path / "ref", split_dataset)
    cfg, run_id = validated_run(tmp_path / "killed", split_dataset, "faults=[{kind: kill, step: 14, rank: 1}]")
    assert_resumed(cfg.tracking.uri, run_id, [0, 10])
    client = MlflowClient(cfg.tracking.uri)
    for c, r in ((ref_cfg, ref_run), (cfg, run_id)):
        for key in (
            "train/val_loss",
            "train/val_perplexity",
        ):  # exactly one value per validated step on the kept timeline
            assert sorted(x.step for x in MlflowClient(c.tracking.uri).get_metric_history(r, key)) == VALIDATED, key
    assert sorted(x.step for x in client.get_metric_history(run_id, "train_discarded/val_loss")) == [12]  # re-run
    val = metric_by_step(cfg, run_id, "train/val_loss")
    assert val == metric_by_step(ref_cfg, ref_run, "train/val_loss")  # bitwise, at every validated step
    assert all(v > 0 and math.isfinite(v) for v in val.values()) and val[18] < val[3]
    perplexity = metric_by_step(cfg, run_id, "train/val_perplexity")
    assert all(perplexity[s] == pytest.approx(math.exp(val[s])) for s in VALIDATED)
    metrics = client.get_run(run_id).data.metrics
    assert metrics["badput_validation_s"] > 0  # its own goodput bucket, not productive time
    assert np.isclose(
        metrics["wall_s"],
        metrics["productive_s"]
        + sum(v for k, v in metrics.items() if k.startswith("badput_"))
        + metrics["unaccounted_s"],
    )
