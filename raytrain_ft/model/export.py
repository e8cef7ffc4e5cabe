"""Export a checkpoint as a Hugging Face model folder that `transformers` loads as it is.

`export_checkpoint(checkpoint, out_dir, data_path)` writes what the trained network's
`save_pretrained` (`LlamaForCausalLM` for a preset, the `hf_config`'s own class otherwise) and a
tokenizer's `save_pretrained` write:

- `config.json`: the network's `transformers` config as trained (the checkpoint's
  `RunMeta.model_config`: a preset's Llama shape, vocabulary and sequence length with dropout 0,
  or the `hf_config`'s own architecture), BOS = EOS =
  the dataset's end-of-document token (documents are packed with one EOS after each, so EOS is also
  what precedes a document: GPT-2's convention);
- `generation_config.json`: the same token ids, EOS as the padding token;
- the weights as safetensors, keys as the network's `state_dict()`: one `model.safetensors`, or
  `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` when they exceed
  `max_shard_size` (huggingface_hub's `split_state_dict_into_shards_factory`, which `save_pretrained`
  uses too);
- `tokenizer.json`, `tokenizer_config.json` (EOS as `eos_token`, `bos_token` and `pad_token`;
  `model_max_length` = the sequence length) from the prepared dataset the run trained on.

The checkpoint is read with `torch.distributed.checkpoint` and no process group (`no_dist=True`),
one tensor per `dcp.load`: DCP assembles each tensor from the chunks the ranks wrote, so a
checkpoint written under any strategy (ddp, fsdp, hsdp) and world size gives the same files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from raytrain_ft.checkpoint.integrity import verify_checkpoint
from raytrain_ft.checkpoint.reader import CheckpointReader
from raytrain_ft.checkpoint.train_state import KEY_MODEL, RunMeta, tied_names
from raytrain_ft.core.errors import CheckpointError, DataError, UserError
from raytrain_ft.core.run_folder import complete_steps, step_path
from raytrain_ft.data.manifest import load_manifest

DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default; transformers 5's save_pretrained uses 50GB
SHARD_PATTERN = "model{suffix}.safetensors"  # huggingface_hub.constants.SAFETENSORS_WEIGHTS_FILE_PATTERN
INDEX_FILE = "model.safetensors.index.json"  # huggingface_hub.constants.SAFETENSORS_INDEX_FILE
FIXED_BYTES = (
    32 * 2**20
)  # part of the bound that does not grow with the model: metadata, the meta-device model, the tokenizer
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Export:
    """What `export_checkpoint` wrote.

    Attributes:
        out_dir: the model folder.
        checkpoint: the checkpoint folder it was read from.
        step: that checkpoint's step.
        mlflow_run_id: the MLflow run that trained it (from the checkpoint's `RunMeta`; "" if none).
        weight_files: the safetensors files, in order.
        total_bytes: bytes of all weights as written.
        architecture: the network's causal-LM class in `transformers` (`LlamaForCausalLM`, `Qwen2ForCausalLM`, ...).
        bound_bytes: the memory bound of this export (see `export_checkpoint`): its largest weight file
            plus twice its largest tensor as saved, plus `FIXED_BYTES`.
    """

    out_dir: str
    checkpoint: str
    step: int
    mlflow_run_id: str
    weight_files: list[str]
    total_bytes: int
    bound_bytes: int
    architecture: str


def check_complete(checkpoint: str, metadata: Metadata, expected: dict[str, torch.Size]) -> None:
    """Before converting: every weight of the model (`expected`: name -> shape, as the network's
    `state_dict()`) is in the checkpoint with that shape, and nothing else is under
    `model.`. That the bytes are there and intact (a truncated or missing file) is `verify_checkpoint`'s
    check, run before this one.

    Raises:
        CheckpointError: one line naming the first missing, unexpected or mis-shaped entries.
    """
    saved = {
        k[len(KEY_MODEL) + 1 :]: m.size
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(KEY_MODEL + ".") and isinstance(m, TensorStorageMetadata)
    }
    problems = [f"missing {k}" for k in expected if k not in saved]
    problems += [f"unexpected {k}" for k in saved if k not in expected]
    problems += [
        f"{k} has shape {tuple(saved[k])}, expected {tuple(s)}" for k, s in expected.items() if saved.get(k, s) != s
    ]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"checkpoint {checkpoint} does not hold this model's weights: {'; '.join(problems[:3])}{more}; "
            "export another step (--step)"
        )


def export_checkpoint(
    checkpoint: str,
    out_dir: str,
    data_path: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str = "float32",
) -> Export:
    """Write the Hugging Face model folder of one checkpoint (see the module docstring for its files).

    Args:
        checkpoint: a complete checkpoint folder (`<run folder>/step-N`, local path or fsspec URL),
            written under any strategy and world size.
        out_dir: a local folder, absent or empty.
        data_path: the prepared dataset the run trained on (its tokenizer is exported; its manifest's
            fingerprint must be the checkpoint's `data.fingerprint`).
        max_shard_size: largest safetensors file, in bytes or as "5GB" / "500MB" (huggingface_hub's
            units: 1GB = 10**9 bytes). A single tensor larger than this gets a file of its own.
        dtype: `float32` (as trained: the weights are copied bit for bit), `bfloat16` or `float16`.

    Memory bound (`Export.bound_bytes`): besides the process itself (torch, transformers
    imported), at most one output file's tensors (`max_shard_size`, or the largest tensor when it is
    larger), plus the one tensor being read in its saved dtype (fp32) and one saved chunk of it (the
    whole tensor under ddp, one rank's part under fsdp) that DCP's reader deserialises before
    copying it in: largest file + 2 x largest saved tensor + `FIXED_BYTES` (32 MiB; the checkpoint's
    metadata, the model built on the meta device, the tokenizer), never the whole model unless it fits
    one file. The embedding and the output layer are the largest tensors (vocab x hidden x 4 bytes: 262 MB
    for the `1b` preset at vocab 32000). `benchmarks/export_memory.py` and
    `tests/unit/test_export_folder.py` measure the peak RSS against it.

    Returns:
        `Export`: the folder, the checkpoint's step and MLflow run id, the weight files and bytes.

    Raises:
        CheckpointError: not a complete checkpoint, or one without this model's weights (see `check_complete`).
        DataError: no dataset at `data_path`, or not the dataset the checkpoint trained on.
        UserError: `out_dir` is not empty, or `dtype` / `max_shard_size` is invalid.
    """
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise UserError(f"{out_dir} is not empty; export into a new or empty folder")
    saved = CheckpointReader(checkpoint, verified=False)  # every byte is verified below, before the weights
    meta, step, metadata = saved.run_meta(), saved.step(), saved.metadata
    fp = meta.fingerprint
    manifest = load_manifest(data_path)
    if manifest.fingerprint != fp["data.fingerprint"]:
        raise DataError(
            f"the dataset at {data_path} is not the one checkpoint {checkpoint} trained on (data fingerprint "
            f"{manifest.fingerprint[:12]} vs {fp['data.fingerprint'][:12]}); pass the run's data.path"
        )
    config = _hf_config(meta, manifest.eos_token_id, DTYPES[dtype])
    expected = _expected_shapes(config)
    damaged = verify_checkpoint(checkpoint, components=False)  # checksums of every stored byte
    if damaged:
        raise CheckpointError(f"checkpoint {checkpoint} is damaged ({damaged[0]}); export an older step (--step)")
    check_complete(checkpoint, metadata, expected)  # and the model's every weight, shaped as the config says

    target = DTYPES[dtype]
    try:
        split = split_state_dict_into_shards_factory(
            expected,  # name -> shape, in the model's state_dict order
            get_storage_size=lambda shape: shape.numel() * target.itemsize,
            get_storage_id=lambda shape: None,  # each weight once (`_expected_shapes`)
            filename_pattern=SHARD_PATTERN,
            max_shard_size=max_shard_size,
        )
    except ValueError as e:
        raise UserError(f"--max-shard-size {max_shard_size!r}: {e}") from None
    os.makedirs(out_dir, exist_ok=True)
    for filename, names in split.filename_to_tensors.items():
        shard = {}
        for name in names:
            key = f"{KEY_MODEL}.{name}"
            entry = metadata.state_dict_metadata[key]
            assert isinstance(entry, TensorStorageMetadata)  # model weights are tensors (check_complete)
            tensor = torch.empty(entry.size, dtype=entry.properties.dtype)
            saved.load({key: tensor})
            shard[name] = tensor.to(target)
        save_file(shard, os.path.join(out_dir, filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)

    config.save_pretrained(out_dir)
    _generation_config(config).save_pretrained(out_dir)
    _tokenizer(data_path, manifest.tokenizer_file, manifest.eos_token_id, manifest.seq_len).save_pretrained(out_dir)
    sizes = {k: s.numel() * target.itemsize for k, s in expected.items()}
    largest_file = max(sum(sizes[k] for k in names) for names in split.filename_to_tensors.values())
    largest_saved = max(
        m.size.numel() * m.properties.dtype.itemsize
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(KEY_MODEL + ".") and isinstance(m, TensorStorageMetadata)
    )
    files = list(split.filename_to_tensors)
    return Export(
        out_dir,
        checkpoint,
        step,
        meta.mlflow_run_id,
        files,
        sum(sizes.values()),
        largest_file + 2 * largest_saved + FIXED_BYTES,
        config.architectures[0],
    )


def _hf_config(meta: RunMeta, eos_id: int, dtype: torch.dtype):
    """The trained network's `transformers` config (the checkpoint's `RunMeta.model_config`; a
    checkpoint that predates it: its preset's), naming its causal-LM class as the architecture, with
    the dataset's end-of-document token as BOS and EOS and `dtype` as the weights' dtype."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    from raytrain_ft.model.causal_lm import model_config

    fp = meta.fingerprint
    if meta.model_config:
        fields = dict(meta.model_config)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = model_config(fp["model.preset"], fp["vocab_size"], fp["seq_len"])
    causal_lm: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    config.architectures = [causal_lm.__name__]
    config.bos_token_id = config.eos_token_id = eos_id
    config.dtype = dtype
    return config


def _expected_shapes(config) -> dict[str, torch.Size]:
    """name -> shape of the causal LM's `state_dict()` for `config`, built on the meta device (no
    memory), each weight once: a tied output embedding is the input's (`train_state.tied_names`),
    stored once in checkpoints and exports (`from_pretrained` ties it again)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = tied_names(model)
    return {k: v.shape for k, v in model.state_dict().items() if k not in tied}


def _generation_config(config):
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(config)
    generation.pad_token_id = config.eos_token_id
    return generation


def _tokenizer(data_path: str, tokenizer_file: str, eos_id: int, seq_len: int):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    with fsspec.open(f"{data_path.rstrip('/')}/{tokenizer_file}", "r") as f:
        tok = Tokenizer.from_str(f.read())
    eos = tok.id_to_token(eos_id)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=eos, model_max_length=seq_len
    )


def choose_checkpoint(run_root: str, step: int | None) -> str:
    """`<run_root>/step-<step>`, or with `step` None the newest complete checkpoint (`.metadata`
    written: every rank's write finished; committed, or complete when the run stopped before its commit).

    Raises:
        CheckpointError: that step has no complete checkpoint (the line lists the ones there are).
    """
    complete = complete_steps(run_root)
    if step is None and complete:
        return step_path(run_root, complete[-1])
    if step in complete:
        return step_path(run_root, step)
    steps = ", ".join(map(str, complete)) or "none"
    raise CheckpointError(f"{run_root} has no complete checkpoint at step {step}; complete steps: {steps}")


def run_data_path(tracking_uri: str, run_id: str) -> str:
    """The `data.path` the run logged as a param to MLflow.

    Raises:
        DataError: the store or run is unreachable or has no such param (pass the path instead).
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    hint = "pass the run's dataset folder with --data"
    if not run_id:
        raise DataError(f"the checkpoint names no MLflow run to read data.path from; {hint}")
    if tracking_uri.startswith("sqlite:///") and not os.path.exists(tracking_uri.removeprefix("sqlite:///")):
        raise DataError(f"no MLflow store at {tracking_uri} to read the run's data.path from; {hint}")
    try:
        params = MlflowClient(tracking_uri).get_run(run_id).data.params
    except MlflowException:
        raise DataError(f"MLflow run {run_id} is not in {tracking_uri}; {hint}") from None
    if "data.path" not in params:
        raise DataError(f"MLflow run {run_id} has no data.path param; {hint}")
    return params["data.path"]


def register(export: Export, name: str, tracking_uri: str):
    """Log the exported folder to the run's MLflow run as a logged model (its files as they are,
    nothing loaded into memory) and register it as a new version of registered model `name`: MLflow's
    Models page lists the version with a link to the run, and the run page lists the logged model.

    The folder is logged through MLflow's client (`create_logged_model`, `log_model_artifacts`,
    `log_outputs`, `create_model_version`), not `mlflow.transformers.log_model`: from a local folder
    that fails on MLflow 3.17 with transformers 5 (`flavor_config.py` reads `__name__` of the task's
    pipeline class, which transformers 5 lists as a string), and from a loaded pipeline it would hold
    the whole model in memory. Load a version with `transformers` from its downloaded artifacts
    (`mlflow.artifacts.download_artifacts("models:/NAME/VERSION")`).

    Returns:
        the new `mlflow.entities.model_registry.ModelVersion` (`run_id` the training run's,
        `model_id` the logged model's).

    Raises:
        UserError: the checkpoint names no MLflow run, or `tracking_uri` does not have it.
    """
    import mlflow
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
    from mlflow.tracking import MlflowClient

    if not export.mlflow_run_id:
        raise UserError(f"checkpoint {export.checkpoint} names no MLflow run to register the model under")
    client = MlflowClient(tracking_uri)
    try:
        run = client.get_run(export.mlflow_run_id)
    except MlflowException:
        raise UserError(
            f"MLflow run {export.mlflow_run_id} is not in {tracking_uri}; point --tracking-uri "
            "(or MLFLOW_TRACKING_URI) at the store the run logged to"
        ) from None
    model = client.create_logged_model(
        run.info.experiment_id,
        name=f"hf-step-{export.step}",
        source_run_id=run.info.run_id,
        tags={"format": "huggingface-transformers", "checkpoint": export.checkpoint},
        model_type=export.architecture,
    )
    client.log_model_artifacts(model.model_id, export.out_dir)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    client.log_outputs(run.info.run_id, [LoggedModelOutput(model.model_id, step=export.step)])
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)  # the registry's sqlalchemy store resolves models:/ in the global store
    try:
        return client.create_model_version(
            name, f"models:/{model.model_id}", run_id=run.info.run_id, model_id=model.model_id
        )
    finally:
        mlflow.set_tracking_uri(previous)
