"""Memory planner: exact against real tensors at 2 gloo ranks; shipped GPU configs fit; DDP 7B is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, assert_tensors_equal
from raytrain_ft.cli import main
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.model.memory import check_fits, plan

VOCAB, SEQ_LEN = 509, 32  # an odd vocabulary: FSDP2 shards of unequal size (rank 0 holds one row more)
LLAMA_VOCAB = 32000  # the vocabulary the GPU configs' corpus is prepared with


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """Per-rank bytes of the real parameters, gradients and AdamW state (tests/scenarios/sharded_state.py)."""
    out = tmp_path_factory.mktemp("bytes")
    script = os.path.join(REPO, "tests", "scenarios", "sharded_state.py")
    sizes = [f"{preset}={VOCAB}={SEQ_LEN}" for preset in ("tiny", "small")]
    r = subprocess.run(
        [sys.executable, script, str(out), "--bytes", *sizes], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return {**json.loads((out / "result.json").read_text()), "out": out}


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_planned_state_bytes_equal_the_real_tensors(measured, preset, strategy):
    for rank, (params, grads, optimizer) in enumerate(measured[f"{preset}/{strategy}"]):
        p = plan(preset, VOCAB, SEQ_LEN, 1, strategy, 2, 2, False, 40.0, gpu=False, rank=rank)
        assert (p.params, p.grads, p.optimizer) == (params, grads, optimizer)
    if strategy == "fsdp":  # the two shards of the parameters add up to one DDP replica
        assert sum(row[0] for row in measured[f"{preset}/fsdp"]) == measured[f"{preset}/ddp"][0][0]


GRAD_NORM_RTOL = 1e-5  # float32 gradients summed in another order (DDP all-reduce vs FSDP reduce-scatter)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_fsdp_grad_norm_is_the_global_one_on_every_rank_and_equals_ddp(measured, preset):
    """Each rank trained on its own tokens and holds half of the gradient: under FSDP every rank's
    clipping norm (and so its skip decision) is the same float, the norm over all shards, as every
    DDP replica's is; and it is DDP's norm for the same batch and initial weights, up to the float32
    rounding of a different reduction order (measured: relative differences 7e-8 tiny, 2.3e-6 small)."""
    fsdp, ddp = measured[f"grad_norm/{preset}/fsdp"], measured[f"grad_norm/{preset}/ddp"]
    assert fsdp[0] == fsdp[1] > 0 and ddp[0] == ddp[1] > 0
    assert fsdp[0] == pytest.approx(ddp[0], rel=GRAD_NORM_RTOL)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_initial_weights_do_not_depend_on_the_strategy(measured, preset):
    """A fresh model draws every full parameter from one generator seeded by `train.seed`, then each
    rank keeps its part (`parallel.materialize`): DDP's replicas and FSDP's shards hold the same
    weights, bitwise (rows in another order would keep per-parameter sums; `torch.equal` does not)."""
    ddp, fsdp = (torch.load(measured["out"] / f"initial-{preset}-{s}.pt") for s in ("ddp", "fsdp"))
    assert len(ddp) == 21 if preset == "tiny" else len(ddp) > 21
    assert_tensors_equal(ddp, fsdp)


@pytest.mark.parametrize("name", ["gpu-7b", "gpu-70b"])
def test_shipped_gpu_configs_fit_their_node_type(name):
    cfg = load_config(os.path.join(REPO, "configs", f"{name}.yaml"))
    assert cfg.scaling.gpu_type == "A100-40GB"  # cluster.yaml's p4d.24xlarge
    p = check_fits(cfg, LLAMA_VOCAB, cfg.train.seq_len)
    assert p.fits and p.device_total < 0.9 * 40 * 1024**3
    assert main(["plan-memory", "--config", os.path.join(REPO, "configs", f"{name}.yaml")]) == 0


def test_a_7b_mistral_config_is_planned_from_its_own_parameters(capsys):
    """Mistral-7B's shape (configs/models/mistral-7b: grouped-query attention, an FFN of 14,336): the
    memory plan and MFU's FLOPs per token come from its 7.24e9 parameters, not the 7b preset's 6.74e9."""
    config = os.path.join(REPO, "configs", "gpu-7b.yaml")
    assert (
        main(["plan-memory", "--config", config, "--hf-config", os.path.join(REPO, "configs", "models", "mistral-7b")])
        == 0
    )
    out = capsys.readouterr().out
    assert "model.hf_config=" in out and "6·7.11e9 + 12·32·4096·2048 = 4.589e+10" in out, out
    assert main(["plan-memory", "--config", config]) == 0
    assert "6·6.61e9 + 12·32·4096·2048 = 4.287e+10" in capsys.readouterr().out


def test_a_ddp_7b_config_is_refused_in_one_line(capsys):
    cfg = load_config(os.path.join(REPO, "configs", "gpu-7b.yaml"), ["parallel.strategy=ddp"])
    with pytest.raises(ConfigError) as e:
        check_fits(cfg, LLAMA_VOCAB, cfg.train.seq_len)
    message = str(e.value)
    assert "\n" not in message and "parallel.strategy=ddp needs about" in message
    assert "A100-40GB has 40 GiB" in message and "parallel.strategy=fsdp or hsdp" in message
    # 7B with AdamW in fp32 is 16 bytes per parameter before activations: over 100 GiB on one GPU
    assert float(message.split("needs about ")[1].split(" GiB")[0]) > 100
    assert main(["plan-memory", "--config", os.path.join(REPO, "configs", "gpu-7b.yaml"), "--strategy", "ddp"]) == 1
    assert "does not fit" in capsys.readouterr().out


def test_hsdp_shard_size_must_divide_the_world_size(capsys):
    config = os.path.join(REPO, "configs", "gpu-70b.yaml")
    assert main(["plan-memory", "--config", config, "--shard-size", "48"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs parallel.shard_size dividing the world size" in err
