"""Held-out validation on real gloo process groups (no Ray): the same checkpoint gives the same
val_loss under FSDP2 at 2 ranks and DDP at 1 rank; validation time is its own goodput bucket.

Tolerance of the cross-strategy comparison: `rel=1e-6`. The per-sequence losses are the same
fp32 computations grouped into different passes (FSDP: 1 sequence per pass, 4 + 3 sequences on
the two ranks, one zero-weight pass; DDP: 2 per pass, 7 on one rank) and summed in float64 in a
different order; measured difference 1.6e-8 relative on the tiny preset (4.19099903 vs 4.19099896).
"""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from raytrain_ft.checkpoint.train_state import ModelState
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.data.manifest import Manifest, Shard
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.model.parallel import build
from raytrain_ft.telemetry.goodput import GoodputLedger
from raytrain_ft.training.validation import Validation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, SEQ, N = 64, 16, 7  # 7 validation sequences: uneven over 2 ranks


def write_dataset(folder: str, rows: np.ndarray) -> Manifest:
    """A prepared-dataset folder (one shard, manifest) holding `rows` int32 (n, SEQ + 1)."""
    os.makedirs(folder, exist_ok=True)
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), SEQ + 1)
    pq.write_table(pa.table({"tokens": tokens}), f"{folder}/shard-000000.parquet", row_group_size=2)
    groups = [min(2, len(rows) - i) for i in range(0, len(rows), 2)]
    m = Manifest(
        len(rows), SEQ, VOCAB, 0, "tokenizer.json", "fp", [Shard("shard-000000.parquet", 0, len(rows), groups)]
    )
    with open(f"{folder}/manifest.json", "w") as f:
        f.write(m.to_json())
    return m


def config(strategy: str, micro_batch_size: int, validation_path: str, *more: str):
    return load_config(
        os.path.join(REPO, "configs", "tiny.yaml"),
        [
            f"parallel.strategy={strategy}",
            f"train.micro_batch_size={micro_batch_size}",
            "validation.interval_steps=5",
            *([f"validation.path={validation_path}"] if validation_path else []),
            *more,
        ],
    )


def val_loss(workdir: str, strategy: str, micro_batch_size: int) -> tuple[float, bool]:
    """This group's val_loss of the checkpoint in `workdir`, and whether train mode was restored."""
    cfg = config(strategy, micro_batch_size, f"{workdir}/val")
    par, _ = build(cfg, VOCAB, SEQ, torch.device("cpu"), resuming=True)
    dcp.load({"model": ModelState(par.model)}, checkpoint_id=f"{workdir}/ckpt")
    train = Manifest(100, SEQ, VOCAB, 0, "tokenizer.json", "fp", [])
    plan = BatchPlan(cfg.train.global_batch_size, micro_batch_size, dist.get_world_size())
    validation = Validation(
        cfg.validation, "unused", train, plan, dist.get_rank(), par, dist.group.WORLD, torch.device("cpu")
    )
    assert validation.maybe_run(4).metrics == {}  # not due
    got = validation.maybe_run(5)
    return got.metrics["val_loss"], par.forward_module.training


def two_ranks(rank: int, workdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store-2", rank=rank, world_size=2)
    torch.set_num_threads(1)
    result = val_loss(workdir, "fsdp", micro_batch_size=1)  # 4 passes per rank; rank 0 has 3 sequences
    if rank == 0:
        torch.save(result, f"{workdir}/fsdp.pt")
    dist.destroy_process_group()


def test_fsdp_at_two_ranks_and_ddp_at_one_give_the_same_val_loss(tmp_path, process_group):
    rows = torch.randint(0, VOCAB, (N, SEQ + 1), generator=torch.Generator().manual_seed(3)).numpy().astype(np.int32)
    write_dataset(str(tmp_path / "val"), rows)
    par, _ = build(config("ddp", 2, ""), VOCAB, SEQ, torch.device("cpu"), resuming=False)
    dcp.save({"model": ModelState(par.model)}, checkpoint_id=str(tmp_path / "ckpt"))

    ddp, restored = val_loss(str(tmp_path), "ddp", micro_batch_size=2)
    mp.start_processes(two_ranks, (str(tmp_path),), nprocs=2, start_method="forkserver")
    fsdp, fsdp_restored = torch.load(tmp_path / "fsdp.pt")

    assert restored and fsdp_restored  # train mode back on
    assert 3.0 < ddp < 6.0  # about ln(64) = 4.16 for random weights: a real loss, not 0 or a sum
    assert fsdp == pytest.approx(ddp, rel=1e-6)
    by_hand = torch.nn.functional.cross_entropy(  # the mean over the 7 sequences, computed directly
        par.forward_module.eval()(input_ids=torch.from_numpy(rows[:, :-1]).long()).logits.flatten(0, 1),
        torch.from_numpy(rows[:, 1:]).long().flatten(),
    )
    assert ddp == pytest.approx(by_hand.item(), rel=1e-6)


def test_a_validation_set_of_another_tokenizer_or_no_split_is_one_line(tmp_path):
    rows = np.zeros((4, SEQ + 1), np.int32)
    write_dataset(str(tmp_path / "val"), rows)
    other = Manifest(100, SEQ * 2, VOCAB, 0, "tokenizer.json", "fp", [])
    plan = BatchPlan(8, 2, 1)
    cfg = config("ddp", 2, str(tmp_path / "val"))
    with pytest.raises(ConfigError, match=r"has \(seq_len, vocab_size, eos\) \(16, 64, 0\) but d has \(32, 64, 0\)"):
        Validation(cfg.validation, "d", other, plan, 0, None, None, torch.device("cpu"))
    cfg = config("ddp", 2, "")
    with pytest.raises(ConfigError, match="d has no validation split; prepare it again"):
        Validation(cfg.validation, "d", other, plan, 0, None, None, torch.device("cpu"))


def test_validation_time_is_its_own_goodput_bucket_not_productive():
    ledger = GoodputLedger()
    ledger.start(100.0)
    ledger.add_step(102.0, stall_s=0.25, skipped=False, validation_s=1.0)
    ledger.add_step(103.0, stall_s=0.0, skipped=True, validation_s=0.5)
    s = ledger.summary(103.0)
    assert s["badput_validation_s"] == 1.5 and s["badput_checkpoint_stall_s"] == 0.25
    assert s["productive_s"] == 0.75 and s["badput_skipped_steps_s"] == 0.5 and s["unaccounted_s"] == 0.0
