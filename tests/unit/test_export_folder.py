"""`raytrain-ft export` on checkpoints written by DCP in this process (no Ray, no process group):
sharded output, dtypes, the memory bound, `--register` into a real MLflow store, and one-line errors
for bad input. Real training runs: tests/test_export.py."""

from __future__ import annotations

import json
import os
import shutil
import sys

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from raytrain_ft.checkpoint.integrity import ChecksummedWriter
from raytrain_ft.checkpoint.reader import CheckpointReader, load_model_state_dict
from raytrain_ft.checkpoint.train_state import KEY_META, KEY_MODEL, KEY_PROGRESS, Pickled, Progress
from raytrain_ft.cli import main
from raytrain_ft.core.errors import CheckpointError, DataError, UserError
from raytrain_ft.model.export import INDEX_FILE, export_checkpoint
from raytrain_ft.telemetry.tracking import start_or_resume_run

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from export_memory import measure, synthetic_checkpoint, synthetic_dataset  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    """(checkpoint, dataset) of the tiny preset, vocab 512, seq_len 64, random fp32 weights, step 7."""
    root = tmp_path_factory.mktemp("tiny")
    return synthetic_checkpoint(str(root / "run"), "tiny", 512, 64, step=7), synthetic_dataset(str(root / "data"), 64)


def exported_weights(out: str) -> dict[str, torch.Tensor]:
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(os.path.join(out, f))
        assert not weights.keys() & part.keys()
        weights.update(part)
    return weights


def test_weights_over_the_threshold_are_sharded_as_save_pretrained_names_them_with_an_index(tiny, tmp_path):
    checkpoint, data = tiny
    limit = 100_000  # bytes; the tiny model has 658688 bytes of weights, its embedding 131072
    e = export_checkpoint(checkpoint, str(tmp_path / "hf"), data, max_shard_size=limit)
    n = len(e.weight_files)
    assert e.step == 7 and n == 7 and e.total_bytes == 658688
    assert e.weight_files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(tmp_path / "hf")) == sorted(
        [
            *e.weight_files,
            INDEX_FILE,
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    index = json.loads((tmp_path / "hf" / INDEX_FILE).read_text())
    saved = load_model_state_dict(checkpoint)
    assert index["metadata"]["total_size"] == e.total_bytes
    assert index["weight_map"].keys() == saved.keys()
    for f in e.weight_files:
        part = load_file(str(tmp_path / "hf" / f))
        assert {k for k, v in index["weight_map"].items() if v == f} == part.keys()
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= limit or len(part) == 1, f  # a tensor over the limit gets a file of its own
    weights = exported_weights(str(tmp_path / "hf"))
    assert weights.keys() == saved.keys()
    for k in saved:
        assert weights[k].dtype == torch.float32 and torch.equal(weights[k], saved[k]), k


def test_under_the_threshold_one_file_and_no_index_and_bfloat16_on_request(tiny, tmp_path):
    checkpoint, data = tiny
    e = export_checkpoint(checkpoint, str(tmp_path / "hf"), data, dtype="bfloat16")
    assert e.weight_files == ["model.safetensors"] and not (tmp_path / "hf" / INDEX_FILE).exists()
    saved, weights = load_model_state_dict(checkpoint), exported_weights(str(tmp_path / "hf"))
    assert weights.keys() == saved.keys()
    for k in saved:
        assert torch.equal(weights[k], saved[k].to(torch.bfloat16)), k
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


def test_peak_rss_of_exporting_a_125m_checkpoint_stays_within_the_stated_bound(tmp_path):
    data = synthetic_dataset(str(tmp_path / "data"), 64)
    checkpoint = synthetic_checkpoint(str(tmp_path / "run"), "125m", 8192, 64)
    r = measure(checkpoint, str(tmp_path / "hf"), data, "20MB")
    assert r["files"] > 10 and r["total_bytes"] > 350 * 2**20
    assert r["bound_bytes"] < r["total_bytes"] / 3  # the bound is far below the model...
    assert 0 < r["peak_increase_bytes"] <= r["bound_bytes"]  # ...and the export stays under it


def test_a_truncated_checkpoint_file_is_refused_in_one_line_before_anything_is_written(tiny, tmp_path):
    checkpoint, data = tiny
    damaged = str(tmp_path / "step-7")
    shutil.copytree(checkpoint, damaged)
    data_file = next(f for f in os.listdir(damaged) if f.endswith(".distcp"))
    with open(os.path.join(damaged, data_file), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(damaged, data_file)) // 2)
    with pytest.raises(CheckpointError, match=rf"is damaged \(.*\({data_file}, bytes \d+-\d+\) fails its checksum\)"):
        export_checkpoint(damaged, str(tmp_path / "hf"), data)
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_missing_a_weight_is_refused_naming_it(tmp_path):
    import torch.distributed.checkpoint as dcp

    data = synthetic_dataset(str(tmp_path / "data"), 64)
    checkpoint = synthetic_checkpoint(str(tmp_path / "run"), "tiny", 512, 64)
    weights = load_model_state_dict(checkpoint)
    del weights["model.norm.weight"]
    saved = CheckpointReader(checkpoint)
    meta, step = saved.run_meta(), saved.step()
    shutil.rmtree(checkpoint)
    state = {KEY_MODEL: weights, KEY_META: meta, KEY_PROGRESS: Pickled(Progress(step))}
    dcp.save(state, storage_writer=ChecksummedWriter(checkpoint), no_dist=True)
    with pytest.raises(CheckpointError, match="does not hold this model's weights: missing model.norm.weight;"):
        export_checkpoint(checkpoint, str(tmp_path / "hf"), data)


def test_another_dataset_or_a_non_empty_folder_is_refused(tiny, tmp_path):
    checkpoint, data = tiny
    other = str(tmp_path / "other")
    shutil.copytree(data, other)
    path = tmp_path / "other" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "fingerprint": "another"}))
    with pytest.raises(DataError, match="is not the one checkpoint .* trained on"):
        export_checkpoint(checkpoint, str(tmp_path / "hf"), other)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UserError, match="is not empty; export into a new or empty folder"):
        export_checkpoint(checkpoint, str(tmp_path / "full"), data)


def test_cli_finds_a_run_folder_and_refuses_a_missing_step_in_one_line(tiny, tmp_path, capsys):
    checkpoint, data = tiny
    root = os.path.dirname(checkpoint)  # <tmp>/tiny/run (by name or id: tests/unit/test_run_resolver.py)
    args = ["export", root, "--data", data]
    assert main([*args, "--step", "3", "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err == f"error: {root} has no complete checkpoint at step 3; complete steps: 7\n"
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert "(step 7)" in capsys.readouterr().out
    assert os.path.exists(tmp_path / "b" / "model.safetensors")


def test_register_logs_the_export_to_the_run_and_registers_a_version_that_points_at_it(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    storage, data = tmp_path / "runs", synthetic_dataset(str(tmp_path / "data"), 64)
    run_id = start_or_resume_run(
        uri,
        "export",
        str(storage / "lm"),
        "lm",
        {"data.path": data, "run.storage_path": str(storage), "run.name": "lm"},
    )
    MlflowClient(uri).set_terminated(run_id)
    synthetic_checkpoint(str(storage / "lm"), "tiny", 512, 64, step=12, mlflow_run_id=run_id)
    out = tmp_path / "hf"
    args = ["export", "lm", "--out", str(out), "--tracking-uri", uri]  # found by name in the store
    assert main([*args, "--register", "tiny-lm"]) == 0  # the dataset found through the run's data.path param
    assert f"registered tiny-lm version 1 (run {run_id})" in capsys.readouterr().out

    client = MlflowClient(uri)
    (version,) = client.search_model_versions("name='tiny-lm'")
    assert version.version == 1 and version.run_id == run_id and version.source.startswith("models:/m-")
    model_id = version.source.removeprefix("models:/")
    logged = client.get_logged_model(model_id)
    assert logged.source_run_id == run_id and logged.name == "hf-step-12" and logged.status == "READY"
    run = client.get_run(run_id)
    assert [(m.model_id, m.step) for m in run.outputs.model_outputs] == [(model_id, 12)]
    assert run.info.status == "FINISHED"  # registering does not touch the run's status
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)  # models:/NAME/VERSION resolves the logged model in the default store
    try:
        files = mlflow.artifacts.download_artifacts("models:/tiny-lm/1")
    finally:
        mlflow.set_tracking_uri(previous)
    registered = AutoModelForCausalLM.from_pretrained(files).state_dict()
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert registered.keys() == exported.keys() and all(torch.equal(registered[k], exported[k]) for k in exported)
    assert main([*args[:-4], "--out", str(tmp_path / "again"), "--tracking-uri", uri, "--register", "tiny-lm"]) == 0
    assert [v.version for v in client.search_model_versions("name='tiny-lm'")] == [2, 1]  # a second export: v2
