"""Any causal LM from a Hugging Face config (`model.hf_config`; the shipped small ones under
configs/models/): each architecture trains on the Ray-free session (tests/local_run.py, 2 gloo ranks)
and a kill resumes bitwise at the step it committed; the export of a non-Llama run loads in
`transformers` as that architecture with the training model's logits; a config that is not a
causal LM, or disagrees with the dataset, is one line at `raytrain-ft check`."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import REPO, assert_resumed, assert_same_state, final_state, make_config, metric_by_step, run_root
from local_run import LocalRunFailed, local_run
from raytrain_ft.checkpoint.reader import CheckpointReader, load_model_state_dict
from raytrain_ft.cli import main
from raytrain_ft.core.config_files import from_dict, to_dict
from raytrain_ft.core.run_folder import step_path
from raytrain_ft.data.manifest import load_manifest
from raytrain_ft.data.order import EpochOrder
from raytrain_ft.launch.driver import run
from raytrain_ft.model.causal_lm import build_model
from raytrain_ft.model.parallel import build

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


# every shipped architecture under FSDP2, which shards it by its own decoder block (the part of the
# strategies that depends on the architecture's module tree), and one under DDP, which wraps the
# whole network whatever its architecture
@pytest.mark.parametrize(
    "arch, cls, strategy",
    [
        ("qwen2-tiny", "Qwen2ForCausalLM", "ddp"),
        ("qwen2-tiny", "Qwen2ForCausalLM", "fsdp"),
        ("mistral-tiny", "MistralForCausalLM", "fsdp"),
        ("gpt-neox-tiny", "GPTNeoXForCausalLM", "fsdp"),  # another module tree (gpt_neox.layers), LayerNorm biases
        ("olmo2-tiny", "Olmo2ForCausalLM", "fsdp"),
    ],
)
def test_a_shipped_architecture_trains_and_a_kill_resumes_bitwise(tmp_path, dataset, arch, cls, strategy):
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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_tied_embeddings_train_resume_bitwise_are_stored_once_and_export_tied(tmp_path, dataset, strategy):
    """`tie_word_embeddings: true` (Qwen2-0.5B's, Gemma's): one parameter under two names. The
    checkpoint holds it once (under the input embedding, as AdamW's state); a kill resumes bitwise
    with the two names still one tensor; the export loads tied in `transformers`, the run's logits."""
    tied = tmp_path / "tied"
    tied.mkdir()
    shutil.copyfile(write_config(tmp_path, tie_word_embeddings=True), tied / "config.json")
    runs = [f"model.hf_config={tied}", f"train.max_steps={STEPS}", f"parallel.strategy={strategy}", "run.name=tied"]
    reference = make_config(tmp_path / "ref", dataset, *runs)
    local_run(reference)
    killed = make_config(tmp_path / "killed", dataset, *runs, KILL)
    run_id = local_run(killed)
    assert_resumed(killed.tracking.uri, run_id, [0, 5])
    state = final_state(killed, STEPS)
    assert_same_state(state, final_state(reference, STEPS))
    assert "lm_head.weight" not in state and "optim.state.model.embed_tokens.weight.exp_avg" in state
    out = tmp_path / "hf"
    assert main(["export", "tied", "--out", str(out), "--tracking-uri", killed.tracking.uri]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    assert torch.equal(hf.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    ours = build_model(killed.model, 512, 32)  # tied: loading the input embedding sets the output one
    missing = ours.load_state_dict({k: v for k, v in state.items() if not k.startswith("optim.")}, strict=False)
    assert missing.missing_keys == ["lm_head.weight"] and ours.lm_head.weight is ours.model.embed_tokens.weight
    inputs = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf.eval()(input_ids=inputs).logits, ours.eval()(input_ids=inputs).logits)


@pytest.fixture(scope="module")
def qwen2_export(tmp_path_factory, dataset) -> str:
    """A finished Qwen2 run (`STEPS`) exported by `raytrain-ft export`: the folder (config, safetensors,
    tokenizer); the run's config is in its parent's `cfg.json`."""
    root = tmp_path_factory.mktemp("qwen2-export")
    cfg = arch_config(root, dataset, "qwen2-tiny")
    local_run(cfg)
    out = root / "hf"
    assert main(["export", cfg.run.name, "--out", str(out), "--tracking-uri", cfg.tracking.uri]) == 0
    (root / "cfg.json").write_text(json.dumps(to_dict(cfg)))
    return str(out)


@torch.no_grad()
def test_the_export_of_a_qwen2_run_loads_as_qwen2_with_the_training_models_logits(qwen2_export, process_group):
    with open(os.path.join(os.path.dirname(qwen2_export), "cfg.json")) as f:
        cfg = from_dict(json.load(f))
    hf = AutoModelForCausalLM.from_pretrained(qwen2_export)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    weights = load_model_state_dict(step_path(run_root(cfg), STEPS))  # the run's last checkpoint
    assert weights.keys() == hf.state_dict().keys()
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in weights.items())
    ours = build_model(cfg.model, 512, 32).eval()  # the training network of the run's config, its weights loaded
    ours.load_state_dict(weights)
    inputs = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hf(input_ids=inputs).logits, ours(input_ids=inputs).logits)


@pytest.mark.usefixtures("ray_local")
def test_a_qwen2_run_on_ray_train_equals_the_ray_free_run(tmp_path, dataset, qwen2_export):
    """The same architecture through Ray Train (`TorchTrainer`, Ray Data input): bitwise equal to the
    Ray-free run the export fixture trained. A kill's resume is the Ray-free tests' above for each
    architecture, and Ray Train's restart is architecture-blind (tests/test_pretrain.py, test_chaos.py)."""
    with open(os.path.join(os.path.dirname(qwen2_export), "cfg.json")) as f:
        uninterrupted = from_dict(json.load(f))
    cfg = arch_config(tmp_path, dataset, "qwen2-tiny")
    run_id = run(cfg)
    assert_resumed(cfg.tracking.uri, run_id, [0])
    assert_same_state(final_state(cfg, STEPS), final_state(uninterrupted, STEPS))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_continued_pretraining_builds_the_folders_weights_at_step_0(
    tmp_path, dataset, qwen2_export, process_group, strategy
):
    cfg = make_config(tmp_path, dataset, f"model.init_from={qwen2_export}", f"parallel.strategy={strategy}")
    par, _ = build(cfg, 512, 32, torch.device("cpu"), resuming=False)
    built = get_model_state_dict(par.model, options=StateDictOptions(full_state_dict=True))
    folder = load_file(os.path.join(qwen2_export, "model.safetensors"))
    assert built.keys() == folder.keys()
    assert all(torch.equal(built[k], v) for k, v in folder.items())


def weights_digest(folder: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


@torch.no_grad()
def test_continued_pretraining_starts_at_the_folders_loss_and_a_resume_never_reads_its_weights(
    tmp_path, dataset, qwen2_export
):
    folder = str(tmp_path / "from")
    shutil.copytree(qwen2_export, folder)
    source = f"{folder} sha256:{weights_digest(folder)}"
    reference = make_config(
        tmp_path / "ref", dataset, "run.name=cpt", f"model.init_from={folder}", f"train.max_steps={STEPS}"
    )
    ref_run = local_run(reference)
    # step 1's loss is the folder's model's loss, as transformers computes it, on step 1's global batch
    m = load_manifest(dataset)
    order = EpochOrder(dataset, m, 0, 0, 8, 2)
    lanes = list(range(order.num_lanes))
    passes = order.micro_batches(lanes, 0, 1, [order.read(order.pieces(lanes, 0, 1))])
    tokens = torch.from_numpy(np.concatenate([mb["tokens"] for mb in passes]))
    hf = AutoModelForCausalLM.from_pretrained(qwen2_export).eval()
    expected = hf(input_ids=tokens, labels=tokens).loss.item()
    assert metric_by_step(reference, ref_run, "train/loss")[1] == pytest.approx(expected, rel=1e-6, abs=0)
    assert CheckpointReader(step_path(run_root(reference), STEPS)).run_meta().fingerprint["model.init_from"] == source

    # killed after step 5's commit with no restart left; then the weights leave the folder, and the
    # resubmission resumes from step 5 without them, bitwise equal to the uninterrupted run
    killed = [f"model.init_from={folder}", f"train.max_steps={STEPS}", "run.name=cpt"]
    with pytest.raises(LocalRunFailed):
        local_run(make_config(tmp_path / "killed", dataset, *killed, KILL, "failure.max_failures=0"))
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        os.remove(path)
    resumed = make_config(tmp_path / "killed", dataset, *killed)
    run_id = local_run(resumed)
    assert_resumed(resumed.tracking.uri, run_id, [0, 5])
    assert_same_state(final_state(resumed, STEPS), final_state(reference, STEPS))
    # the source stays in the fingerprint of every checkpoint after step 0, though the resume never read it
    assert CheckpointReader(step_path(run_root(resumed), STEPS)).run_meta().fingerprint["model.init_from"] == source


def check(tmp_path, dataset, capsys, hf_config: str, *overrides: str) -> str:
    """The last line `raytrain-ft check` prints for the tiny config with `model.hf_config` (if any) and `overrides`."""
    local = [f"data.path={dataset}", f"run.storage_path={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    args = [*local, *([f"model.hf_config={hf_config}"] if hf_config else []), *overrides]
    assert main(["check", "--config", os.path.join(REPO, "configs", "tiny.yaml"), *args]) != 0
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


def init_from_folder(tmp_path, qwen2_export, damage) -> str:
    folder = tmp_path / f"from-{len(os.listdir(tmp_path))}"
    shutil.copytree(qwen2_export, folder)
    damage(folder)
    return str(folder)


def other_tokenizer(folder) -> None:
    """Two token ids swapped: the same size, another meaning for two ids."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tok))


@pytest.mark.parametrize(
    "damage, says",
    [
        (other_tokenizer, "'s tokenizer is not the dataset's (2 of 512 token ids differ)"),
        (lambda f: (f / "tokenizer.json").unlink(), "holds no tokenizer.json"),
        (lambda f: (f / "model.safetensors").unlink(), "holds no *.safetensors weights"),
        (lambda f: (f / "config.json").unlink(), "cannot read"),
    ],
)
def test_a_folder_without_the_datasets_tokenizer_or_weights_is_one_line(
    tmp_path, dataset, capsys, qwen2_export, damage, says
):
    line = check(tmp_path, dataset, capsys, "", f"model.init_from={init_from_folder(tmp_path, qwen2_export, damage)}")
    assert "config key 'model.init_from'" in line and says in line, line


def test_init_from_and_hf_config_together_are_one_line(tmp_path, dataset, capsys, qwen2_export):
    line = check(tmp_path, dataset, capsys, shipped("qwen2-tiny"), f"model.init_from={qwen2_export}")
    assert "'model.init_from' and 'model.hf_config' are both set" in line, line
