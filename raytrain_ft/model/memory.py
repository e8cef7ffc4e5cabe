"""Per-device memory estimate of a training config, before any GPU is touched.

`plan(...)` returns the bytes one device needs, by part. Parameters, gradients and optimizer state
are exact: they are the shapes of the model (built on the `meta` device, no memory) sharded the
way FSDP2 shards them (dim 0 in `world`-sized chunks as `torch.chunk`, rank 0 holding the largest),
so they equal the summed sizes of the real tensors (tested). The rest is an estimate:

* parameters: fp32 master weights, full (ddp) or this rank's shards (fsdp/hsdp, shard group size S);
* gradients: fp32, same layout as the parameters;
* optimizer: AdamW's `exp_avg` and `exp_avg_sq` (fp32, parameter layout) + one 4-byte `step`
  tensor per parameter tensor;
* buffers: ddp: DDP's gradient buckets (a second fp32 copy of every gradient); fsdp/hsdp: the
  unsharded parameters in compute dtype of the root (embeddings, final norm, output layer: FSDP2
  keeps the root unsharded between forward and backward) and of two decoder layers (the one
  computing and the one prefetched), plus one layer's unsharded fp32 gradients before its
  reduce-scatter;
* activations of one micro-batch (b = micro_batch_size, s = seq_len, h = hidden, L = layers,
  V = vocabulary), after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models" (arXiv:2205.05198), Section 4.1, Eq. (1): a transformer layer stores
  s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations. SDPA's fused attention (flash /
  memory-efficient kernels) never stores the a·s² score, softmax and dropout-mask terms, which is
  the paper's "selective recomputation" case: 34·s·b·h bytes per layer. With per-layer activation
  checkpointing only each layer's 16-bit input (2·s·b·h bytes) is kept, plus one layer's full
  activations while it is recomputed. The logits add s·b·V·(2 + 4 + 4) bytes (bf16 logits, the
  fp32 copy for the loss, fp32 softmax gradient). fp32 compute (CPU) doubles the 16-bit terms.
  Llama's SwiGLU MLP (3 matrices of width ~2.7h) stores about what the paper's 4h GELU MLP does.
* staging (host, per node, not device memory): pinned host memory for the async checkpoint
  snapshot: parameters + optimizer state of every rank on the node.

A config fits when the device total is at most `HEADROOM` (90 %) of the device memory: the CUDA
context, NCCL buffers and allocator fragmentation take the rest.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from raytrain_ft.core.config import Config, ModelSection
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.model.causal_lm import build_model, decoder_layers, model_name
from raytrain_ft.model.hardware import device_memory_gib
from raytrain_ft.model.parallel import mesh_shape, resolve_strategy

GIB = 1024**3
HEADROOM = 0.9
ADAMW_MOMENTS = 2  # exp_avg, exp_avg_sq
STEP_BYTES = 4  # AdamW's per-parameter `step` tensor (float32 scalar)
KORTHIKANTI_PER_LAYER = 34  # bytes per s·b·h of one layer, 16-bit activations, attention scores not stored


@dataclass
class MemoryPlan:
    """Bytes per device by part (see the module docstring), and the device memory it is checked against."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    staging_per_node: int  # host memory, not counted in `device_total`
    device_memory: int

    @property
    def device_total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + self.activations

    @property
    def fits(self) -> bool:
        return self.device_total <= HEADROOM * self.device_memory

    def as_dict(self) -> dict:
        return {**asdict(self), "device_total": self.device_total, "fits": self.fits}


def shard_numel(shape: torch.Size, shards: int, rank: int = 0) -> int:
    """Elements of `rank`'s FSDP2 shard of a tensor of `shape` (dim 0 split as `torch.chunk`)."""
    if not shape:
        return 1 if rank == 0 else 0
    chunk = math.ceil(shape[0] / shards)
    rows = max(0, min(chunk, shape[0] - rank * chunk))
    return rows * math.prod(shape[1:])


def plan(
    model: ModelSection | str,
    vocab_size: int,
    seq_len: int,
    micro_batch_size: int,
    strategy: str,
    shard_size: int,
    ranks_per_node: int,
    activation_checkpointing: bool,
    device_memory_gib: float,
    gpu: bool = True,
    rank: int = 0,
) -> MemoryPlan:
    """Memory of one device (rank `rank`; rank 0 holds the largest shards) training `model` (a
    `ModelSection`: a preset or any hf_config's architecture, its real parameters' shapes; or a
    preset's name).

    Args:
        strategy: `ddp`, `fsdp` or `hsdp` (resolved, not `auto`).
        shard_size: ranks one model is sharded over (fsdp: the world size; hsdp: `parallel.shard_size`;
            ignored under ddp).
        ranks_per_node: ranks (GPUs) on one node, for the host staging figure.
        gpu: bf16 compute (True) or fp32 (CPU).

    Returns:
        a `MemoryPlan` in bytes.
    """
    with torch.device("meta"):
        network = build_model(model, vocab_size, seq_len)
    shards, shard_rank = (1, 0) if strategy == "ddp" else (shard_size, rank % shard_size)
    shapes = [p.shape for p in network.parameters()]
    local = sum(shard_numel(s, shards, shard_rank) for s in shapes)
    params = grads = 4 * local
    optimizer = ADAMW_MOMENTS * 4 * local + STEP_BYTES * len(shapes)
    compute_bytes = 2 if gpu else 4
    layers = decoder_layers(network)
    if strategy == "ddp":
        buffers = grads
    else:
        layer = sum(p.numel() for p in layers[0].parameters())
        root = sum(p.numel() for p in network.parameters()) - layer * len(layers)
        buffers = compute_bytes * (root + 2 * layer) + 4 * layer
    config: Any = network.config
    sbh = seq_len * micro_batch_size * config.hidden_size
    scale = compute_bytes / 2  # the formula counts 16-bit activations
    full_layer = KORTHIKANTI_PER_LAYER * sbh * scale
    # with checkpointing: every layer's input kept, one layer's activations recomputed at a time
    layer_acts = 2 * sbh * scale * len(layers) + full_layer if activation_checkpointing else full_layer * len(layers)
    logits = seq_len * micro_batch_size * vocab_size * (compute_bytes + 4 + 4)
    return MemoryPlan(
        params=params,
        grads=grads,
        optimizer=optimizer,
        buffers=int(buffers),
        activations=int(layer_acts + logits),
        staging_per_node=(params + optimizer) * ranks_per_node,
        device_memory=int(device_memory_gib * GIB),
    )


def plan_config(cfg: Config, vocab_size: int, seq_len: int, world_size: int | None = None) -> MemoryPlan:
    """`plan` for a run config on its `scaling.gpu_type`, at `world_size` (default: the smallest of the
    elastic range, where shards are largest).

    Raises:
        ConfigError: hsdp with a shard size that does not divide the world size.
    """
    strategy = resolve_strategy(cfg.parallel, cfg.scaling.use_gpu)
    world_size = world_size or cfg.worker_range[0]
    _, shard_size = mesh_shape(
        strategy, world_size, cfg.parallel.shard_size or min(cfg.scaling.gpus_per_node, world_size)
    )
    return plan(
        cfg.model,
        vocab_size,
        seq_len,
        cfg.train.micro_batch_size,
        strategy,
        shard_size,
        min(cfg.scaling.gpus_per_node, world_size),
        cfg.parallel.activation_checkpointing,
        device_memory_gib(cfg.scaling),
        gpu=cfg.scaling.use_gpu,
    )


def check_fits(cfg: Config, vocab_size: int, seq_len: int) -> MemoryPlan:
    """The driver's preflight for GPU configs.

    Raises:
        ConfigError: one line with the estimate, the device memory and the fixes.
    """
    p = plan_config(cfg, vocab_size, seq_len)
    if not p.fits:
        strategy = resolve_strategy(cfg.parallel, cfg.scaling.use_gpu)
        raise ConfigError(
            f"{model_name(cfg.model)} with parallel.strategy={strategy} needs about "
            f"{p.device_total / GIB:.1f} GiB per GPU (parameters {p.params / GIB:.1f}, gradients {p.grads / GIB:.1f}, "
            f"optimizer {p.optimizer / GIB:.1f}, buffers {p.buffers / GIB:.1f}, activations {p.activations / GIB:.1f}) "
            f"but a {cfg.scaling.gpu_type} has {p.device_memory / GIB:.0f} GiB ({HEADROOM:.0%} usable); use "
            "parallel.strategy=fsdp or hsdp, a smaller train.micro_batch_size, or "
            "parallel.activation_checkpointing=true (see raytrain-ft plan-memory)"
        )
    return p
