"""Any causal LM from a Hugging Face config (`model.hf_config`; the shipped small ones under
configs/models/): each architecture trains on the Ray-free session (tests/local_run.py, 2 gloo ranks)
and a kill resumes bitwise at the step it committed; the export of a non-Llama run loads in
`transformers` as that architecture with the training model's logits; a config that is not a
causal LM, or disagrees with the dataset, is one line at `raytrain-ft check`."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import REPO, assert_resumed, assert_same_state, final_state, make_config, run_root
from local_run import local_run
from raytrain_ft.checkpoint.reader import CheckpointReader, load_model_state_dict
from raytrain_ft.cli import main
from raytrain_ft.model.causal_lm import build_model
from raytrain_ft.run_folder import step_path

STEPS = 10
KILL = "faults=[{kind: kill, step: 7, rank: 1}]"  # after step 5's commit: the restart resumes from 5


def shipped(name: str) -> str:
    return os.path.join(REPO, "configs", "models", name)


def arch_config(tmp_path, dataset, arch: str, *overrides: str):
    return make_config(
        tmp_path,
        dataset,
        f"run.name={arch}",
        f"model.hf_config={shipped(arch)}",
        f"train.max_steps={STEPS}",
        *overrides,
    )


# every shipped architecture under DDP, and two under FSDP2 (its own decoder block is the unit it shards)
@pytest.mark.parametrize(
    "arch, strategy, cls",
    [
        ("qwen2-tiny", "ddp", "Qwen2ForCausalLM"),
        ("mistral-tiny", "ddp", "MistralForCausalLM"),
        ("gpt-neox-tiny", "ddp", "GPTNeoXForCausalLM"),
        ("olmo2-tiny", "fsdp", "Olmo2ForCausalLM"),
        ("gpt-neox-tiny", "fsdp", "GPTNeoXForCausalLM"),  # another module tree (gpt_neox.layers), LayerNorm biases
    ],
)
def test_a_shipped_architecture_trains_and_a_kill_resumes_bitwise(tmp_path, dataset, arch, strategy, cls):
    reference = arch_config(tmp_path / "ref", dataset, arch, f"parallel.strategy={strategy}")
    local_run(reference)
    killed = arch_config(tmp_path / "killed", dataset, arch, f"parallel.strategy={strategy}", KILL)
    run_id = local_run(killed)
    assert_resumed(killed.tracking.uri, run_id, [0, 5])
    assert_same_state(final_state(killed, STEPS), final_state(reference, STEPS))
    # the network is the config's architecture, at the config's sizes, and the checkpoint says so
    meta = CheckpointReader(step_path(run_root(killed), STEPS)).run_meta()
    with open(os.path.join(shipped(arch), "config.json")) as f:
        source = json.load(f)
    assert meta.model_config["model_type"] == source["model_type"]
    assert meta.model_config["hidden_size"] == 64 and meta.fingerprint["model.hf_config"].startswith(
        source["model_type"]
    )
    fields = dict(meta.model_config)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert type(built).__name__ == cls


@pytest.mark.usefixtures("ray_local")
@torch.no_grad()
def test_the_export_of_a_qwen2_run_loads_as_qwen2_with_the_training_models_logits(tmp_path, dataset, process_group):
    cfg = arch_config(tmp_path, dataset, "qwen2-tiny")
    local_run(cfg)
    out = tmp_path / "hf"
    assert main(["export", cfg.run.name, "--out", str(out), "--tracking-uri", cfg.tracking.uri]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    weights = load_model_state_dict(step_path(run_root(cfg), STEPS))  # the run's last checkpoint
    assert weights.keys() == hf.state_dict().keys()
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in weights.items())
    ours = build_model(cfg.model, 512, 32).eval()  # the training network of the run's config, its weights loaded
    ours.load_state_dict(weights)
    inputs = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hf(input_ids=inputs).logits, ours(input_ids=inputs).logits)


def check(tmp_path, dataset, capsys, hf_config: str) -> str:
    local = [f"data.path={dataset}", f"run.storage_path={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    assert (
        main(["check", "--config", os.path.join(REPO, "configs", "tiny.yaml"), *local, f"model.hf_config={hf_config}"])
        != 0
    )
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1]


def write_config(tmp_path, **fields) -> str:
    with open(os.path.join(shipped("qwen2-tiny"), "config.json")) as f:
        config = {**json.load(f), **fields}
    path = tmp_path / f"config-{len(os.listdir(tmp_path))}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"model_type": "t5"}, "is a t5 config, which AutoModelForCausalLM does not build"),
        ({"vocab_size": 256}, "has vocab_size 256, fewer than the dataset's 512 token ids"),
        ({"max_position_embeddings": 16}, "has max_position_embeddings 16, fewer than the dataset's seq_len 32"),
        ({"tie_word_embeddings": True}, "ties the input and output embeddings"),
    ],
)
def test_a_config_that_is_not_a_causal_lm_or_disagrees_with_the_dataset_is_one_line(
    tmp_path, dataset, capsys, fields, says
):
    line = check(tmp_path, dataset, capsys, write_config(tmp_path, **fields))
    assert "config key 'model.hf_config'" in line and says in line, line


def test_a_missing_config_is_one_line(tmp_path, dataset, capsys):
    line = check(tmp_path, dataset, capsys, str(tmp_path / "nowhere"))
    assert "cannot read" in line and "config.json" in line, line
