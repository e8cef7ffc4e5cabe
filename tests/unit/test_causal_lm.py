"""`raytrain_ft.model.causal_lm` as pure functions of a config (models built on the meta device)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import REPO
from raytrain_ft.checkpoint.train_state import tied_names
from raytrain_ft.core.config import ModelSection
from raytrain_ft.model.causal_lm import build_model, decoder_layers, flops_per_token, model_id

MODELS = os.path.join(REPO, "configs", "models")


@pytest.mark.parametrize(
    "name, block",
    [
        ("qwen2-tiny", "Qwen2DecoderLayer"),
        ("mistral-tiny", "MistralDecoderLayer"),
        ("gpt-neox-tiny", "GPTNeoXLayer"),
        ("olmo2-tiny", "Olmo2DecoderLayer"),
    ],
)
def test_the_decoder_block_is_the_architectures_own(name, block):
    with torch.device("meta"):
        model = build_model(ModelSection(hf_config=os.path.join(MODELS, name)), 512, 32)
    layers = decoder_layers(model)
    assert [type(m).__name__ for m in layers] == [block, block]  # 2 layers in every shipped config
    assert flops_per_token(model, 32) == 6 * (sum(p.numel() for p in model.parameters()) - 512 * 64) + 12 * 2 * 64 * 32


def test_the_fingerprint_names_the_configs_contents_not_its_path(tmp_path):
    copy = tmp_path / "elsewhere"
    shutil.copytree(os.path.join(MODELS, "qwen2-tiny"), copy)
    original = model_id(ModelSection(hf_config=os.path.join(MODELS, "qwen2-tiny")))
    assert model_id(ModelSection(hf_config=str(copy / "config.json"))) == original
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    changed = model_id(ModelSection(hf_config=str(copy)))
    assert changed != original and changed["model.hf_config"].startswith("qwen2:")
    assert model_id(ModelSection(preset="small")) == {"model.preset": "small"}


def test_a_mixture_of_experts_reports_no_mfu(tmp_path):
    moe = {
        "model_type": "mixtral",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(moe))
    with torch.device("meta"):
        model = build_model(ModelSection(hf_config=str(tmp_path)), 512, 32)
    assert type(model).__name__ == "MixtralForCausalLM" and flops_per_token(model, 32) is None


def test_a_tied_output_embedding_is_one_parameter_its_matmul_counted_and_its_name_left_out(tmp_path):
    """Tied: the 512 x 64 matrix is the output projection's weight (6·N counts its matmul), and the
    model's state names it twice, the second name (`lm_head.weight`) left out of checkpoints."""
    with open(os.path.join(MODELS, "qwen2-tiny", "config.json")) as f:
        config = {**json.load(f), "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        tied = build_model(ModelSection(hf_config=str(tmp_path)), 512, 32)
        untied = build_model(ModelSection(hf_config=os.path.join(MODELS, "qwen2-tiny")), 512, 32)
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == 512 * 64
    assert flops_per_token(tied, 32) == flops_per_token(untied, 32)  # the same matmuls
    assert tied_names(tied) == {"lm_head.weight"} and tied_names(untied) == set()
