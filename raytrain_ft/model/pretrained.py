"""Continued pretraining: step 0 starts from the weights of a Hugging Face model folder (`model.init_from`).

The folder is what `save_pretrained` (or `raytrain-ft export`) writes: `config.json` (the
architecture: it takes the place of `model.hf_config`), the weights as safetensors (one file or
shards with `model.safetensors.index.json`), and `tokenizer.json`. Decisions:

- The weights are read once, at step 0, by DCP's `HuggingFaceStorageReader` straight into the
  model each rank holds (under FSDP2/HSDP each rank reads only its shards; safetensors' dtype is
  cast to the training dtype); a resume never reads them again: after step 0 the checkpoint is the
  truth (`config.json` is read on every start, as `model.hf_config` is).
- The folder must hold the dataset's tokenizer (the same token -> id vocabulary as the prepared
  dataset's `tokenizer.json`); a folder with another tokenizer, or none, is refused in one line:
  weights trained on other token ids would train on without an error and learn nonsense.
- The run's fingerprint records the source: `model.init_from` = the folder and the SHA-256 of its
  safetensors files (name and contents, in name order), computed by rank 0 at step 0 and carried
  by every checkpoint after it; a resume does not compare it (nothing is read from the folder then).
"""

from __future__ import annotations

import glob
import hashlib
import os

import fsspec
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from raytrain_ft.core.config import ModelSection
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.data.manifest import Manifest

TOKENIZER_FILE = "tokenizer.json"


def weight_files(folder: str) -> list[str]:
    """The folder's safetensors files, in name order.

    Raises:
        ConfigError: the folder holds none.
    """
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ConfigError(
            f"config key 'model.init_from': {folder} holds no *.safetensors weights; give a folder that "
            "save_pretrained or raytrain-ft export wrote"
        )
    return files


def check_init_from(model: ModelSection, data_path: str, manifest: Manifest) -> None:
    """Refuse a `model.init_from` folder without weights, or whose tokenizer is not the dataset's
    (module doc). A no-op without `init_from`.

    Raises:
        ConfigError: one line naming the folder and the fix.
    """
    if not model.init_from:
        return
    from tokenizers import Tokenizer

    weight_files(model.init_from)
    ours = os.path.join(model.init_from, TOKENIZER_FILE)
    if not os.path.exists(ours):
        raise ConfigError(
            f"config key 'model.init_from': {model.init_from} holds no {TOKENIZER_FILE}, so nothing says its "
            "weights learned the dataset's token ids; add the tokenizer the model was trained with"
        )
    with fsspec.open(f"{data_path.rstrip('/')}/{manifest.tokenizer_file}", "r") as f:
        data_vocab = Tokenizer.from_str(f.read()).get_vocab(with_added_tokens=True)
    vocab = Tokenizer.from_file(ours).get_vocab(with_added_tokens=True)
    if vocab != data_vocab:
        differ = sum(1 for t, i in vocab.items() if data_vocab.get(t) != i) + len(data_vocab.keys() - vocab.keys())
        raise ConfigError(
            f"config key 'model.init_from': {model.init_from}'s tokenizer is not the dataset's ({differ} of "
            f"{max(len(vocab), len(data_vocab))} token ids differ); prepare the data with that tokenizer "
            f"(jobs/prepare_data.py --tokenizer {ours})"
        )


def weights_sha256(folder: str) -> str:
    """SHA-256 (hex) of the folder's safetensors files: each file's name, then its bytes, in name order."""
    digest = hashlib.sha256()
    for path in weight_files(folder):
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


@torch.no_grad()
def load_pretrained(model: torch.nn.Module, folder: str) -> None:
    """Copy the folder's weights into `model` (materialised; plain tensors or FSDP2 `DTensor`
    shards, before any DDP wrapper), every parameter of it: each rank reads what it holds.

    Raises:
        RuntimeError: from DCP, naming a parameter the folder lacks or a shape that differs.
    """
    state = get_model_state_dict(model)  # the parameters themselves (FQNs without wrapper prefixes)
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(folder))
    set_model_state_dict(model, state)
