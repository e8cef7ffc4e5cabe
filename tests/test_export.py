"""`raytrain-ft export` of real runs (tiny preset): `transformers` loads the folder and computes
what the training model computes (`--register`: tests/unit/test_export_folder.py).

The runs are the suite's shared uninterrupted 30-step runs at 2 workers (`conftest.reference`, DDP,
on Ray; `conftest.fsdp_ref`, FSDP, on the Ray-free session of tests/local_run.py): no training of
its own. The training side of each comparison is restored by the project's own restore
(`Checkpointer.restore`, in a one-rank gloo group); the other side is `transformers`'
`from_pretrained` alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_config, run_root
from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.fingerprint import fingerprint
from raytrain_ft.checkpoint.train_state import KEY_META, KEY_MODEL, ModelState, RunMeta, TrainState
from raytrain_ft.cli import main
from raytrain_ft.core.run_folder import step_path
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.model.causal_lm import model_id
from raytrain_ft.model.parallel import build

pytestmark = pytest.mark.usefixtures("ray_local")

STEPS = 30  # both shared runs end at step 30
TEXT = '"""JSON (JavaScript Object Notation) <http://json.org> is a subset of\nJavaScript syntax."""\n'


def restored_model(cfg, step: int) -> torch.nn.Module:
    """The training model (one rank, ddp) with the checkpoint of `step` loaded by `Checkpointer.restore`."""
    manifest = load_manifest(cfg.data.path)
    one_rank = make_config(Path(cfg.run.storage_path).parent, cfg.data.path, f"run.name={cfg.run.name}")
    par, _ = build(one_rank, manifest.vocab_size, manifest.seq_len, torch.device("cpu"), resuming=True)
    num_params = sum(p.numel() for p in par.model.parameters())
    state = TrainState(0)
    state.add(KEY_MODEL, ModelState(par.model))
    state.add(KEY_META, RunMeta(fingerprint(cfg, manifest, num_params, model_id(cfg.model))))
    loaded, keys = Checkpointer(run_root(cfg)).restore(
        state, [step_path(run_root(cfg), step)], lambda path, reason: pytest.fail(f"{path}: {reason}")
    )
    assert loaded == step_path(run_root(cfg), step) and keys == {KEY_MODEL}  # the run metadata is the config's
    return par.model.eval()


def batch(cfg, rows: int = 4) -> torch.Tensor:
    """The first `rows` samples of the dataset, inputs only: int64 (rows, seq_len)."""
    manifest = load_manifest(cfg.data.path)
    tokens = pq.read_table(os.path.join(cfg.data.path, manifest.shards[0].file)).column("tokens")
    return torch.tensor(tokens.to_pylist()[:rows], dtype=torch.int64)[:, :-1]


def export_args(cfg, out) -> list[str]:
    """The CLI line: the run by name, the dataset found through the run's MLflow params."""
    return ["export", cfg.run.name, "--out", str(out)] + [
        "--tracking-uri",
        cfg.tracking.uri,
    ]


@pytest.mark.parametrize("which", ["fsdp_ref", "reference"])
@torch.no_grad()
def test_transformers_loads_the_export_computes_the_training_models_logits_and_samples(
    which, request, tmp_path, process_group, capsys
):
    cfg = request.getfixturevalue(which)[0]
    out = tmp_path / "hf"
    assert main(export_args(cfg, out)) == 0
    assert f"step-{STEPS} (step {STEPS})" in capsys.readouterr().out  # the newest checkpoint by default

    inputs = batch(cfg)
    ours = restored_model(cfg, STEPS)(input_ids=inputs).logits
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.float32 and not hf.training
    theirs = hf(input_ids=inputs).logits
    assert theirs.shape == (4, 32, 512) and torch.equal(theirs, ours)

    manifest = load_manifest(cfg.data.path)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(TEXT).input_ids
    assert ids == Tokenizer.from_file(os.path.join(cfg.data.path, "tokenizer.json")).encode(TEXT).ids
    assert tok.decode(ids) == TEXT and len(ids) > 5
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == manifest.eos_token_id
    assert tok.model_max_length == manifest.seq_len

    sampled = hf.generate(inputs[:1, :8], max_new_tokens=6, do_sample=False)
    assert sampled.shape == (1, 14) and torch.equal(sampled[0, :8], inputs[0, :8])
    assert sampled[0, 8] == ours[0, 7].argmax()  # greedy: the training model's most likely next token
