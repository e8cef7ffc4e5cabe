"""Gloo ranks (torch only, no Ray) load checkpoints under another strategy or world size and measure
real state sizes.

Run by tests/test_sharding.py and tests/test_memory.py in a subprocess. Usage:

    python sharded_state.py OUT [--world-size N] NAME=CHECKPOINT=STRATEGY ... [--bytes PRESET=VOCAB=SEQ_LEN ...]

OUT/result.json always gets {"world_size": N, ...} (N: 2 unless given).

* `NAME=CHECKPOINT=STRATEGY`: build the tiny model under STRATEGY at N ranks (`raytrain_ft.model.parallel`),
  load the model and AdamW state of CHECKPOINT into it through the restore a resume runs
  (`Checkpointer.restore`: every byte verified, the optimizer state allocated from the checkpoint's
  metadata, every entry required; the run's own metadata, so the fingerprint matches), gather
  the full tensors and write them (rank 0) to OUT/NAME.pt, keyed like `conftest.final_state`.
* `--bytes PRESET=VOCAB=SEQ_LEN`: for ddp and fsdp, one forward/backward (each rank its own
  tokens, the same under both strategies), `Parallel.clip_grad_norm_`, one AdamW step, then every
  rank's summed bytes of its parameters, gradients and optimizer-state tensors (local shards) go to
  OUT/result.json as {"PRESET/STRATEGY": [[params, grads, optimizer] per rank]}, and the grad norm
  each rank got as {"grad_norm/PRESET/STRATEGY": [norm per rank]}; the fresh model's full weights
  before that step go (rank 0) to OUT/initial-PRESET-STRATEGY.pt (`torch.save` of the state dict).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.reader import peek
from raytrain_ft.checkpoint.train_state import (
    KEY_META,
    KEY_MODEL,
    KEY_OPTIM,
    ModelState,
    OptimizerState,
    RunMeta,
    TrainState,
)
from raytrain_ft.core.config_files import load_config
from raytrain_ft.model.causal_lm import lm_loss
from raytrain_ft.model.parallel import build, local

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def refuse(path: str, reason: str) -> None:
    raise AssertionError(f"{path} did not load: {reason}")


def load_full(out: str, name: str, checkpoint: str, strategy: str) -> None:
    cfg = load_config(None, ["model.preset=tiny", f"parallel.strategy={strategy}"])
    meta = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    vocab, hidden = meta["model.model.embed_tokens.weight"].size
    par, optimizer = build(cfg, vocab, 32, torch.device("cpu"), resuming=True)
    state = TrainState(dist.get_rank())
    state.add(KEY_MODEL, ModelState(par.model))
    state.add(KEY_OPTIM, OptimizerState(par.model, optimizer))
    run_meta = RunMeta(fingerprint={})
    peek(checkpoint, {KEY_META: run_meta})  # the run's own: this load is that run resuming at another size
    state.add(KEY_META, run_meta)
    loaded, keys = Checkpointer(os.path.dirname(checkpoint)).restore(state, [checkpoint], on_corrupt=refuse)
    assert loaded == checkpoint and keys == {KEY_MODEL, KEY_OPTIM}, (loaded, keys)
    model = get_model_state_dict(par.model, options=FULL)
    optim, _ = flatten_state_dict(get_optimizer_state_dict(par.model, optimizer, options=FULL))
    if dist.get_rank() == 0:
        tensors = {f"optim.{k}": v for k, v in optim.items() if isinstance(v, torch.Tensor)}
        torch.save({**model, **tensors}, os.path.join(out, f"{name}.pt"))


def state_bytes(out: str, preset: str, vocab: int, seq_len: int, strategy: str) -> tuple[list[int], float]:
    cfg = load_config(None, [f"model.preset={preset}", f"parallel.strategy={strategy}"])
    par, optimizer = build(cfg, vocab, seq_len, torch.device("cpu"), resuming=False)
    initial = get_model_state_dict(par.model, options=FULL)  # on rank 0 only
    if dist.get_rank() == 0:
        torch.save(initial, os.path.join(out, f"initial-{preset}-{strategy}.pt"))
    tokens = torch.randint(0, vocab, (1, seq_len + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    with par.micro_batch(last=True):
        lm_loss(par.forward_module, tokens).backward()
    norm = par.clip_grad_norm_(1e9)  # no clipping: the gradients keep their size for the byte count
    optimizer.step()
    params = list(par.model.parameters())
    optim = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    sizes = [sum(local(t).numel() * t.element_size() for t in ts) for ts in (params, [p.grad for p in params], optim)]
    return sizes, norm


def worker(rank: int, world_size: int, store: str, out: str, loads: list[str], sizes: list[str]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    for spec in loads:
        load_full(out, *spec.split("="))
    measured = {}
    for spec in sizes:
        preset, vocab, seq_len = spec.split("=")
        for strategy in ("ddp", "fsdp"):
            result = state_bytes(out, preset, int(vocab), int(seq_len), strategy)
            rows = [None] * world_size
            dist.all_gather_object(rows, result)
            measured[f"{preset}/{strategy}"] = [r[0] for r in rows]
            measured[f"grad_norm/{preset}/{strategy}"] = [r[1] for r in rows]
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"world_size": world_size, **measured}, f)
    dist.destroy_process_group()


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    world_size = 2
    if args[:1] == ["--world-size"]:
        world_size, args = int(args[1]), args[2:]
    split = args.index("--bytes") if "--bytes" in args else len(args)
    os.makedirs(out, exist_ok=True)
    store = os.path.join(tempfile.mkdtemp(), "store")
    # forkserver: a rank ends with os._exit, skipping the interpreter's finalization, where a spawned
    # rank aborted about one run in eight ("terminate called without an active exception").
    mp.start_processes(
        worker,
        args=(world_size, store, out, args[:split], args[split + 1 :]),
        nprocs=world_size,
        start_method="forkserver",
    )


if __name__ == "__main__":
    main()
