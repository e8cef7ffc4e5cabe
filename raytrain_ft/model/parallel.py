"""Data-parallel strategy: DDP, FSDP2 or HSDP. The only module that knows which one runs.

`build(cfg, vocab_size, seq_len, device, resuming)` is the single entry (shaped like TorchTitan's
`parallelize_llama`): it builds the model, applies activation checkpointing, then the strategy,
then the optimizer, and returns a `Parallel` that answers everything the loop needs
(forward module, gradient-sync context, clipping, replica layout). The loop never branches on it.

Strategies (`parallel.strategy`):

* `ddp`: every rank holds the full model and optimizer; `DistributedDataParallel` all-reduces
  gradients once per step (on the last micro-batch). Under `scaling.use_gpu`, bf16 autocast.
* `fsdp`: PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) on every decoder layer and at the
  root over a 1-D `DeviceMesh` of all ranks: each rank keeps 1/world_size of the parameters,
  gradients and AdamW moments (as `DTensor` shards); a layer's parameters are all-gathered for its
  forward and backward and freed after, gradients are reduce-scattered after every micro-batch
  (so accumulation stays sharded; no `no_sync`, as TorchTitan).
* `hsdp`: the same over a 2-D mesh `(replicate, shard)` of shape
  `(world_size / shard_size, shard_size)`, ranks row-major (a shard group is `shard_size`
  consecutive ranks: one node's GPUs). Parameters are sharded within a group and replicated across
  groups; gradients are reduce-scattered within the group and all-reduced across replicas.
* every strategy averages gradients over all `world_size` ranks (DDP's all-reduce, FSDP2's
  reduce-scatter, HSDP's both): the loop weighs each pass so that the average is the gradient of
  the mean loss over the global batch at any split (`raytrain_ft.data.position.BatchPlan`).
* `auto` (default): `fsdp` when `scaling.use_gpu`, `ddp` on CPU (CPU runs are tests and demos,
  where a full replica per rank is small and DDP is the faster path; see `benchmarks/sharding.py`).

Mixed precision under FSDP/HSDP on GPU: `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`: fp32 master weights and AdamW state in the shards, bf16 copies for compute,
fp32 gradient reduction. On CPU everything is fp32.

Activation checkpointing (`parallel.activation_checkpointing`): each decoder layer is wrapped by
PyTorch's `checkpoint_wrapper` (non-reentrant `torch.utils.checkpoint`, RNG state preserved so
dropout is recomputed identically); only the layer inputs are kept, the rest is recomputed in
backward. State-dict keys are unchanged (`torch.distributed.checkpoint.state_dict` strips the
wrapper's prefix), so checkpoints move freely between strategies and world sizes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_ft.core.config import Config, ParallelSection
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.model.causal_lm import build_model, decoder_layers, lm_loss
from raytrain_ft.model.pretrained import load_pretrained


def resolve_strategy(p: ParallelSection, use_gpu: bool) -> str:
    """`ddp`, `fsdp` or `hsdp`: `auto` is `fsdp` on GPUs and `ddp` on CPU."""
    if p.strategy == "auto":
        return "fsdp" if use_gpu else "ddp"
    return p.strategy


def mesh_shape(strategy: str, world_size: int, shard_size: int) -> tuple[int, int]:
    """(replicas, ranks per shard group) of a strategy: ddp (W, 1), fsdp (1, W), hsdp (W / S, S).

    Raises:
        ConfigError: hsdp with a `shard_size` that does not divide `world_size`.
    """
    if strategy == "ddp":
        return world_size, 1
    if strategy == "fsdp":
        return 1, world_size
    if shard_size < 1 or world_size % shard_size:
        raise ConfigError(
            f"parallel.strategy=hsdp needs parallel.shard_size dividing the world size; got shard_size {shard_size} "
            f"at world size {world_size}; set parallel.shard_size to a divisor (e.g. the GPUs of one node)"
        )
    return world_size // shard_size, shard_size


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a `DTensor`, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Parallel:
    """The wrapped model of one rank and what its strategy means for the loop.

    Attributes:
        strategy: `ddp`, `fsdp` or `hsdp`.
        forward_module: what forward and backward run through: the DDP wrapper under ddp, the
            sharded model itself under fsdp/hsdp. Never checkpointed or inspected.
        model: the unwrapped HF model: its parameters (shards under fsdp/hsdp) are clipped,
            fingerprinted and checkpointed.
        replicas, shard_size: the mesh shape; `replicas x shard_size == world_size`.
        shard_index: which shard of the parameters this rank holds (0 under ddp).
        mixed_precision: bf16 compute (GPU only).
    """

    strategy: str
    forward_module: torch.nn.Module
    model: torch.nn.Module
    replicas: int
    shard_size: int
    shard_index: int
    mixed_precision: bool

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward and backward. DDP skips its all-reduce unless `last`;
        DDP on GPU computes under bf16 autocast (FSDP's policy casts the parameters instead)."""
        stack = contextlib.ExitStack()
        if self.strategy == "ddp":
            if not last:
                stack.enter_context(self.forward_module.no_sync())
            if self.mixed_precision:
                stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        return stack

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip to a global L2 norm of `max_norm`; return the norm before clipping (a float, NaN/inf kept).

        Under FSDP the gradients are `DTensor` shards: `get_total_norm` reduces the shards' partial
        norms over the mesh (a collective), so every rank gets the same float, and so the same skip
        decision; `full_tensor()` turns the result into a plain tensor. As
        `torchtitan.distributed.utils.clip_grad_norm_`.
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm)

    @property
    def has_replicas(self) -> bool:
        """False under fsdp: no two ranks hold the same weights, so there is nothing to compare."""
        return self.replicas > 1

    def tags(self) -> dict[str, str]:
        """MLflow tags: the strategy and the mesh (whether the replica fingerprint applies:
        `guards.RankChecks.tags`, since under replica recovery the replicas are other process groups)."""
        return {
            "parallel.strategy": self.strategy,
            "parallel.mesh": f"{self.replicas} replicas x {self.shard_size} shards",
        }

    def local_parameters(self) -> list[torch.Tensor]:
        """This rank's parameter tensors (shards under FSDP), in model order."""
        return [local(p) for p in self.model.parameters()]


def build(
    cfg: Config, vocab_size: int, seq_len: int, device: torch.device, resuming: bool
) -> tuple[Parallel, torch.optim.Optimizer]:
    """The model of `cfg.model` wrapped by the strategy, and its AdamW, on every rank of the default group.

    The model is built on the `meta` device (no memory: a 70B model would need 280 GB of host
    memory per rank otherwise), wrapped, and allocated on `device` by `materialize`: under
    fsdp/hsdp each rank allocates only its shards, so no rank ever holds the full model. Its
    weights do not depend on the strategy, the mesh or the world size: drawn from `train.seed`, or
    under `model.init_from` read from that folder (`raytrain_ft.model.pretrained`). `resuming`: a checkpoint is
    about to overwrite every parameter, so the weights are left uninitialised and DDP skips its
    initial broadcast (`init_sync`): drawing and broadcasting weights that the load replaces cost a
    restart ~1 s on the reference machine (a kill probe of the demo config). AdamW is PyTorch's `fused`
    implementation (CPU and CUDA): one kernel per step instead of a Python loop over parameters,
    and its state is created at the first step or restore without a per-parameter loop.

    Raises:
        ConfigError: hsdp with a shard size that does not divide the world size.
    """
    strategy = resolve_strategy(cfg.parallel, cfg.scaling.use_gpu)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    shard_size = cfg.parallel.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    replicas, shard_size = mesh_shape(strategy, world_size, shard_size)
    with torch.device("meta"):
        model = build_model(cfg.model, vocab_size, seq_len)
    layers = decoder_layers(model)  # the architecture's own block: FSDP2's unit, checkpointing's too
    if cfg.parallel.activation_checkpointing:
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    mixed = device.type == "cuda"
    pretrained = cfg.model.init_from if not resuming else ""  # step 0 of continued pretraining
    seed = None if resuming or pretrained else cfg.train.seed
    forward_module: torch.nn.Module
    if strategy == "ddp":
        materialize(model, seed, device)
        if pretrained:
            load_pretrained(model, pretrained)
        # no buffer broadcast in every forward: the only buffers (the rotary embedding's) are computed
        # alike on every rank, and a collective in forward would put a wait in `straggler.ComputeTimer`
        ids = [device.index] if mixed else None
        forward_module = DDP(model, device_ids=ids, init_sync=not resuming, forward_sync_buffers=False)
    else:
        if strategy == "hsdp":
            mesh = init_device_mesh(device.type, (replicas, shard_size), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (shard_size,), mesh_dim_names=("shard",))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
        kwargs: dict[str, Any] = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        materialize(model, seed, device)
        if pretrained:
            load_pretrained(model, pretrained)
        forward_module = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, fused=True)
    shard_index = rank % shard_size if strategy != "ddp" else 0
    par = Parallel(strategy, forward_module, model, replicas, shard_size, shard_index, mixed)
    if strategy == "ddp":
        settle_buckets(par, seq_len, device)
    return par, optimizer


def settle_buckets(par: Parallel, seq_len: int, device: torch.device) -> None:
    """One zero-weight forward/backward in eval mode (no dropout: no RNG is drawn), so that DDP
    rebuilds its gradient buckets in ready order before the attempt's first real step.

    DDP reduces the first iteration in its initial bucket layout (reverse parameter order) and
    every later one in the layout it rebuilds from the first backward's ready order. An element's
    position in a bucket decides where the all-reduce's ring starts summing it; with 3 or more
    ranks float addition is then done in another order. Without this pass the first step of every
    attempt used the initial layout: a run resumed at step 10 reduced step 11 differently from the
    uninterrupted run and ended a few ulps apart (tests/test_uneven.py, 3 workers). Costs one
    forward/backward of one sequence per attempt.
    """
    par.model.eval()
    tokens = torch.zeros((1, seq_len + 1), dtype=torch.int64, device=device)
    with torch.enable_grad(), par.micro_batch(last=True):  # a caller may build under no_grad (evaluation)
        (lm_loss(par.forward_module, tokens) * 0.0).backward()
    par.model.zero_grad(set_to_none=True)
    par.model.train()


@torch.no_grad()
def materialize(model: torch.nn.Module, seed: int | None, device: torch.device) -> None:
    """Allocate a meta-built (possibly sharded) model on `device` and initialise it as `transformers`
    initialises its decoder LMs (normalisation weights 1, biases 0, every other weight
    normal(0, `initializer_range`)), one parameter at a time; `seed` None: leave the parameters
    uninitialised (a checkpoint load follows).

    Each drawn parameter's full tensor comes from one generator seeded with `seed`, in parameter
    order, and a sharded parameter (`DTensor`) keeps this rank's shard of it, so the weights do not
    depend on the strategy, the world size or the mesh. The rotary embeddings' buffers (not
    parameters, not in checkpoints) are computed again (every `*RotaryEmbedding` of `transformers`
    is built from the model's config).
    """
    model.to_empty(device=device)
    lm: Any = model
    lm.tie_weights()  # to_empty gives each module its own tensor: a tied output embedding is the input's again
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child).__name__.endswith("RotaryEmbedding"):
                setattr(parent, name, type(child)(model.config).to(device))
    if seed is None:
        return
    generator = torch.Generator(device).manual_seed(seed)
    config: Any = model.config
    std = config.initializer_range
    for name, p in model.named_parameters():
        full = torch.empty(p.shape, device=device)
        if name.endswith("norm.weight"):
            full.fill_(1.0)
        elif name.endswith(".bias"):
            full.zero_()
        else:
            full.normal_(0.0, std, generator=generator)
        p.copy_(
            distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else full
        )
