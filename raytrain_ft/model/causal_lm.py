"""The network: any decoder-only causal LM that Hugging Face `transformers` builds from a config
(random init, nothing downloaded), and the project's Llama presets as shorthands.

`model.hf_config` names a local `config.json` (or a folder holding one) of any architecture
`AutoModelForCausalLM.from_config` builds (Qwen2/3, Mistral, GPT-NeoX, OLMo2, Phi-3, Llama, ...);
shipped small ones are under `configs/models/`; `model.init_from` names a model folder whose
`config.json` is the architecture and whose weights start step 0 (`raytrain_ft.model.pretrained`).
Without them, `model.preset` picks a Llama shape:
`tiny` ~1M parameters (tests), `small` ~27M (demo), then the usual `125m`, `1b`, `7b` and `70b`
shapes (GPU clusters), with the vocabulary size from the dataset. Decisions: an `hf_config` keeps
its own sizes and dropout (`model.dropout` sets a preset's attention dropout only); its vocabulary
must hold the dataset's token ids and its `max_position_embeddings` the dataset's `seq_len`, else
one line (`ConfigError`). Tied input and output embeddings (`tie_word_embeddings: true`) are one
parameter: stored once in checkpoints and exports, under the input embedding's name
(`raytrain_ft.checkpoint.train_state.tied_names`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from raytrain_ft.core.config import ModelSection
from raytrain_ft.core.errors import ConfigError

# hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 4, 172),
    "small": (512, 6, 8, 8, 1376),
    "125m": (768, 12, 12, 12, 2048),
    "1b": (2048, 16, 32, 8, 8192),
    "7b": (4096, 32, 32, 32, 11008),
    "70b": (8192, 80, 64, 8, 28672),
}


def source_key(model: ModelSection) -> str:
    """The config key that names the architecture's `config.json`: `model.init_from` (its folder's,
    `raytrain_ft.model.pretrained`) or `model.hf_config`; "" for a preset."""
    return "model.init_from" if model.init_from else "model.hf_config" if model.hf_config else ""


def source_config(model: ModelSection) -> dict[str, Any] | None:
    """The architecture's `config.json` contents (a dict with `model_type`), from `model.init_from`'s
    folder or `model.hf_config`; None for a preset.

    Raises:
        ConfigError: both keys set; no such file (or folder without `config.json`), not JSON, or
            no `model_type`.
    """
    key = source_key(model)
    if not key:
        return None
    if model.init_from and model.hf_config:
        raise ConfigError(
            "config keys 'model.init_from' and 'model.hf_config' are both set; the folder's config.json is the "
            "architecture of a run that starts from its weights, so leave model.hf_config empty"
        )
    path = model.init_from or model.hf_config
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            found = json.load(f)
    except OSError as e:
        raise ConfigError(
            f"config key '{key}': cannot read {path} ({e.strerror}); give a Hugging Face config.json or its folder"
        ) from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config key '{key}': {path} is not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(found, dict) or "model_type" not in found:
        raise ConfigError(f"config key '{key}': {path} has no model_type; is it a Hugging Face config.json?")
    return found


def model_id(model: ModelSection) -> dict[str, Any]:
    """What identifies the network in a checkpoint's fingerprint: the preset's name, or the
    `hf_config`'s architecture and the SHA-256 of its contents (not its path: the same config
    resumes from any folder). The config itself is in the checkpoint (`RunMeta`, for export)."""
    source = source_config(model)
    if source is None:
        return {"model.preset": model.preset}
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()
    return {"model.hf_config": f"{source['model_type']}:{digest[:16]}"}


def model_name(model: ModelSection) -> str:
    """How messages name the network: `model.preset=<name>`, `model.hf_config=<path>` or `model.init_from=<path>`."""
    key = source_key(model)
    return f"{key}={model.init_from or model.hf_config}" if key else f"model.preset={model.preset}"


def model_config(model: ModelSection | str, vocab_size: int, seq_len: int) -> PretrainedConfig:
    """The `transformers` config of `model` (a `ModelSection`, or a preset's name) for a dataset of
    `vocab_size` token ids and sequences of `seq_len` tokens (module doc).

    Raises:
        ConfigError: an unknown preset; a `config.json` (`source_config`) that is not a causal LM,
            ties its embeddings, or whose vocabulary or positions are smaller than the dataset's.
    """
    section = ModelSection(preset=model) if isinstance(model, str) else model
    source = source_config(section)
    if source is None:
        return _preset_config(section.preset, vocab_size, seq_len, section.dropout)
    key, path = source_key(section), section.init_from or section.hf_config
    fields = {k: v for k, v in source.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(source["model_type"], **fields)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"config key '{key}': {path}: {e}") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"config key '{key}': {path} is a {config.model_type} config, which "
            "AutoModelForCausalLM does not build; give a decoder-only causal LM (qwen2, mistral, gpt_neox, ...)"
        )
    if config.vocab_size < vocab_size:
        raise ConfigError(
            f"config key '{key}': {path} has vocab_size {config.vocab_size}, fewer than "
            f"the dataset's {vocab_size} token ids; raise vocab_size in the config or prepare the data with a "
            "smaller vocabulary"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and positions < seq_len:
        raise ConfigError(
            f"config key '{key}': {path} has max_position_embeddings {positions}, fewer "
            f"than the dataset's seq_len {seq_len}; raise it in the config or prepare shorter sequences"
        )
    return config


def _preset_config(preset: str, vocab_size: int, seq_len: int, dropout: float) -> LlamaConfig:
    if preset not in PRESETS:
        raise ConfigError(f"config key 'model.preset' is {preset!r}; valid presets: {', '.join(PRESETS)}")
    hidden, layers, heads, kv_heads, ffn = PRESETS[preset]
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=seq_len,
        attention_dropout=dropout,
        tie_word_embeddings=False,
    )


def build_model(model: ModelSection | str, vocab_size: int, seq_len: int) -> PreTrainedModel:
    """A randomly initialised causal LM of `model_config(model, vocab_size, seq_len)` (fp32 weights;
    autocast handles bf16 on GPU), SDPA attention. Build it under `torch.device("meta")` for shapes
    alone (`raytrain_ft.model.parallel.materialize` allocates and initialises it).

    Raises:
        ConfigError: as `model_config`.
    """
    return AutoModelForCausalLM.from_config(model_config(model, vocab_size, seq_len), attn_implementation="sdpa")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's repeated decoder blocks: the `ModuleList` of its `_no_split_modules` class (what
    `transformers` itself never splits across devices), which FSDP2 wraps and activation
    checkpointing recomputes one at a time.

    Raises:
        ConfigError: the model declares no block class, or no list of them was found.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and module and all(type(m).__name__ in names for m in module):
            return module
    raise ConfigError(f"{type(model).__name__} names no repeated decoder block (_no_split_modules: {sorted(names)})")


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy.

    Args:
        tokens: int64 (batch, seq_len + 1); inputs are `tokens[:, :-1]`, labels `tokens[:, 1:]`.
    Returns:
        scalar float32 loss.
    """
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float | None:
    """Training FLOPs per token (forward + backward): 6·N + 12·L·h·s, for a dense model of any
    architecture (from its config and its parameters); None for a mixture of experts (a token
    runs through some experts only: MFU is not reported for it).

    N is the number of parameters without the input embedding (a lookup, no matmul; tied to the
    output embedding, it is that matmul's weight and counts), L the
    decoder layers, h the hidden size, s the sequence length; 12·L·h·s counts the attention score
    and value matmuls (Q·K^T and A·V). Source: Chowdhery et al. 2022, "PaLM", Appendix B (MFU).
    """
    lm: Any = model  # a transformers causal LM: its config
    c = lm.config
    if max(getattr(c, "num_local_experts", 0) or 0, getattr(c, "num_experts", 0) or 0) > 1:
        return None
    return 6 * matmul_params(model) + 12 * c.num_hidden_layers * c.hidden_size * seq_len


def matmul_params(model: torch.nn.Module) -> int:
    """N of `flops_per_token`: the parameters without the input embedding, unless it is tied to the
    output embedding (then it is that matmul's weight and counts)."""
    lm: Any = model  # a transformers causal LM: its embeddings
    embedding = lm.get_input_embeddings().weight
    tied = lm.get_output_embeddings().weight is embedding
    return sum(p.numel() for p in model.parameters()) - (0 if tied else embedding.numel())
