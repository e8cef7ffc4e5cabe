"""Decoder-only LM presets built from HF `transformers` Llama (random init, nothing downloaded).

Sizes (with vocab 8192): `tiny` ~1M parameters (tests), `small` ~27M (demo), then the usual
`125m`, `1b`, `7b` and `70b` shapes (GPU clusters). The vocabulary size comes from the dataset.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from raytrain_ft.errors import ConfigError

# hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 4, 172),
    "small": (512, 6, 8, 8, 1376),
    "125m": (768, 12, 12, 12, 2048),
    "1b": (2048, 16, 32, 8, 8192),
    "7b": (4096, 32, 32, 32, 11008),
    "70b": (8192, 80, 64, 8, 28672),
}


def model_config(preset: str, vocab_size: int, seq_len: int, dropout: float) -> LlamaConfig:
    """Llama config of a preset.

    Raises:
        ConfigError: unknown preset name.
    """
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


def build_model(preset: str, vocab_size: int, seq_len: int, dropout: float) -> LlamaForCausalLM:
    """A randomly initialised `LlamaForCausalLM` (fp32 weights; autocast handles bf16 on GPU)."""
    config = model_config(preset, vocab_size, seq_len, dropout)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def lm_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy.

    Args:
        tokens: int64 (batch, seq_len + 1); inputs are `tokens[:, :-1]`, labels `tokens[:, 1:]`.
    Returns:
        scalar float32 loss.
    """
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6·N + 12·L·h·s.

    N is the number of parameters without the input embedding (a lookup, no matmul), L the
    decoder layers, h the hidden size, s the sequence length; 12·L·h·s counts the attention score
    and value matmuls (Q·K^T and A·V). Source: Chowdhery et al. 2022, "PaLM", Appendix B (MFU).
    """
    c = model.config
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len
