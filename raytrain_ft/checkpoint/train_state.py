"""Everything a checkpoint holds, under named keys, as `torch.distributed.checkpoint` Statefuls.

Tensor state (model weights, AdamW's m and v) goes through
`torch.distributed.checkpoint.state_dict`'s `get_*_state_dict` / `set_*_state_dict`, so DCP shards
and reshards it. Every other component (LR scheduler, step, data position, RNG states, guards,
run metadata) is pickled to bytes when the snapshot is taken: the bytes are immutable, so training
may continue while the writer runs. RNG states differ per rank and live under `rng.rank{R}`; the
goodput ledger (`raytrain_ft.telemetry.goodput`) is rank 0's alone, under `goodput`.
`run_state` assembles a rank's; adding a component is one line there.
"""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

KEY_MODEL = "model"
KEY_OPTIM = "optim"
KEY_SCHEDULER = "scheduler"
KEY_PROGRESS = "progress"
KEY_DATA = "data"
KEY_GUARDS = "guards"
KEY_ROLLBACKS = "rollbacks"
KEY_META = "meta"
KEY_GOODPUT = "goodput"  # rank 0 only: its GoodputLedger
KEY_RNG_PREFIX = "rng.rank"
# every component of a run's checkpoint besides one `rng.rank{R}` per rank (the keys `Trainer` adds)
COMPONENT_KEYS = (
    KEY_MODEL,
    KEY_OPTIM,
    KEY_SCHEDULER,
    KEY_PROGRESS,
    KEY_DATA,
    KEY_GUARDS,
    KEY_ROLLBACKS,
    KEY_META,
    KEY_GOODPUT,
)


def rng_key(rank: int) -> str:
    return f"{KEY_RNG_PREFIX}{rank}"


def _component(key: str) -> str:
    """The component a flattened checkpoint key belongs to: `optim.state.x.exp_avg` -> `optim`,
    `rng.rank1.pickle` -> `rng.rank1`."""
    head, _, rest = key.partition(".")
    return f"{head}.{rest.split('.', 1)[0]}" if key.startswith(KEY_RNG_PREFIX) else head


def missing_components(saved: Iterable[str], required: Iterable[str] | None = None) -> list[str]:
    """What a checkpoint lacks of a run's train state, one phrase per missing piece ([] if complete).

    Args:
        saved: the checkpoint's flattened keys (its DCP `state_dict_metadata`, e.g.
            `optim.state.lm_head.weight.exp_avg`).
        required: the component keys one rank's state holds (`TrainState.components`); None: a whole run's
            (`COMPONENT_KEYS`, and `rng.rank{R}` of every rank below the highest the checkpoint has).

    The one allowed absence is `rng.rank{R}` of a rank R at or beyond the ranks the checkpoint holds RNG
    states for: a rank an elastic resize added (it seeds fresh). Beyond whole components, every model
    tensor needs its optimizer state (`optim.state.<name>.*`): AdamW holds state for every trained
    parameter once a step ran, and checkpoints are taken after steps.
    """
    saved = set(saved)
    present = {_component(k) for k in saved}
    ranks = [int(k[len(KEY_RNG_PREFIX) :]) for k in present if k.startswith(KEY_RNG_PREFIX)]
    if required is None:
        required = [*COMPONENT_KEYS, *(rng_key(r) for r in range(max(ranks, default=0) + 1))]
    required = list(required)

    def added_by_resize(key: str) -> bool:
        return key.startswith(KEY_RNG_PREFIX) and bool(ranks) and int(key[len(KEY_RNG_PREFIX) :]) > max(ranks)

    missing = [f"no {key!r} entries" for key in required if key not in present and not added_by_resize(key)]
    if KEY_OPTIM in required and KEY_OPTIM in present:
        model, state = f"{KEY_MODEL}.", f"{KEY_OPTIM}.state."
        with_state = {k[len(state) :].rsplit(".", 1)[0] for k in saved if k.startswith(state)}
        lacking = sorted(k[len(model) :] for k in saved if k.startswith(model) and k[len(model) :] not in with_state)
        if lacking:
            more = f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else ""
            missing.append(f"no optimizer state for {lacking[0]!r}{more}")
    return missing


def tied_names(model: torch.nn.Module) -> set[str]:
    """The names under which a parameter is registered a second (third, ...) time, as in a
    `state_dict` (wrapper prefixes removed): a tied output embedding (`lm_head.weight` when
    `tie_word_embeddings`). Its first name, in registration order, is the one AdamW's state is under."""
    first: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        name = name.replace("_checkpoint_wrapped_module.", "")
        if first.setdefault(id(p), name) != name:
            tied.add(name)
    return tied


class ModelState(Stateful):
    """The model's weights, keys as the unwrapped HF model's `state_dict` (DDP prefix removed),
    each parameter once: a tied name (`tied_names`) is left out and comes back with its first."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.tied = model, tied_names(model)

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in get_model_state_dict(self.model).items() if k not in self.tied}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Raises: RuntimeError: a weight missing from `state` (other than a tied name) or one the model lacks."""
        keys = set_model_state_dict(self.model, state, options=StateDictOptions(strict=False))
        if set(keys.missing_keys) - self.tied or keys.unexpected_keys:
            raise RuntimeError(
                f"model weights do not match: missing {keys.missing_keys}, unexpected {keys.unexpected_keys}"
            )


class OptimizerState(Stateful):
    """AdamW state (step, exp_avg = m, exp_avg_sq = v) keyed by parameter name, so it reshards."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state)

    def allocate(self, saved: dict[str, Any]) -> None:
        """Create the optimizer's state as uninitialised tensors for a checkpoint load to fill.

        `saved`: the checkpoint's DCP metadata under this component's key (`state.<fqn>.<name>` ->
        `TensorStorageMetadata`). Without this, `get_optimizer_state_dict` creates the state the
        only way a generic optimizer allows (`torch.distributed.checkpoint.state_dict._init_optim_state`):
        a zero gradient per parameter and one optimizer step at lr 0, which the load then
        overwrites. That step cost 1.05 s of a 1.44 s restore on each of 2 ranks of the demo config
        (27M params, fused AdamW, 2 cores; cProfile of `dcp.load`), on the recovery's critical path.

        Every parameter gets each per-parameter state the checkpoint holds, with its dtype: a 0-dim
        entry (AdamW's `step`) as a 0-dim tensor, any other (`exp_avg`, `exp_avg_sq`) shaped and,
        under FSDP, sharded like the parameter (`empty_like`), as the optimizer itself would.
        Left to DCP when the optimizer already has state, or when the checkpoint's entries are not
        the same for every parameter (an optimizer whose state differs between parameters).
        """
        if self.optimizer.state:
            return
        names: dict[str, dict[str, Any]] = {}
        for key, meta in saved.items():
            if key.startswith("state.") and hasattr(meta, "size"):
                fqn, name = key[len("state.") :].rsplit(".", 1)
                names.setdefault(fqn, {})[name] = meta
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        kinds = {tuple(sorted((n, m.properties.dtype, len(m.size) == 0) for n, m in e.items())) for e in names.values()}
        if len(kinds) != 1 or len(names) != len(params):
            return
        for p in params:
            self.optimizer.state[p] = {
                name: torch.zeros((), dtype=dtype, device=p.device) if scalar else torch.empty_like(p, dtype=dtype)
                for name, dtype, scalar in next(iter(kinds))
            }


class Pickled(Stateful):
    """Wraps an object with `state_dict`/`load_state_dict`; its state is saved as one bytes leaf."""

    def __init__(self, obj: Any):
        self.obj = obj

    def state_dict(self) -> dict[str, bytes]:
        return {"pickle": pickle.dumps(self.obj.state_dict())}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        self.obj.load_state_dict(pickle.loads(state["pickle"]))


@dataclass
class Progress:
    """Optimizer steps taken (skipped steps included)."""

    step: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class RNGState:
    """python `random`, numpy, torch CPU and every CUDA device's generator state of this rank."""

    def state_dict(self) -> dict:
        return {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if state["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def seed_rngs(seed: int, rank: int) -> None:
    """Fresh-start seeding: every generator from (seed, rank), so dropout differs across ranks."""
    random.seed(seed * 1000 + rank)
    np.random.seed(seed * 1000 + rank)
    torch.manual_seed(seed * 1000 + rank)


# What a checkpoint written before `train.lr_schedule` existed planned: its run still resumes.
PRE_SCHEDULE_FINGERPRINT = {"train.lr_schedule": "cosine", "train.decay_steps": 0}


@dataclass
class RunMeta:
    """What must match between a checkpoint and the run loading it, plus the MLflow run id, the
    network's `transformers` config (what `raytrain-ft export` writes back) and the fingerprint's
    history: one `{"at_step", "from_max_steps", "max_steps"}` per extension of the run
    (`raytrain_ft.core.schedule.extension_refusal`), oldest first."""

    fingerprint: dict
    mlflow_run_id: str = ""
    history: list[dict] = field(default_factory=list)
    model_config: dict = field(default_factory=dict)  # the network's `transformers` config (`to_dict()`), for export

    def state_dict(self) -> dict:
        meta = {
            "fingerprint": self.fingerprint,
            "mlflow_run_id": self.mlflow_run_id,
            "history": self.history,
            "model_config": self.model_config,
        }
        return {"json": json.dumps(meta)}

    def load_state_dict(self, state: dict) -> None:
        d = json.loads(state["json"])
        self.fingerprint = {**PRE_SCHEDULE_FINGERPRINT, **d["fingerprint"]}
        self.mlflow_run_id, self.history = d["mlflow_run_id"], d.get("history", [])
        self.model_config = d.get("model_config", {})


class TrainState:
    """The named components of one rank's train state."""

    def __init__(self, rank: int):
        self.rank = rank
        self.components: dict[str, Stateful] = {}

    def add(self, key: str, component: Stateful) -> None:
        self.components[key] = component

    def allocate(self, saved: dict[str, Any]) -> None:
        """Before a load: let each component whose state a load would otherwise first compute
        create it empty (`OptimizerState.allocate`). `saved`: the checkpoint's `state_dict_metadata`."""
        for key, c in self.components.items():
            if isinstance(c, OptimizerState):
                prefix = key + "."
                c.allocate({k[len(prefix) :]: m for k, m in saved.items() if k.startswith(prefix)})

    def snapshot(self) -> dict[str, Any]:
        """State dict for `dcp.async_save`: tensors by reference (DCP stages them), the rest as bytes."""
        return {key: c.state_dict() for key, c in self.components.items()}


def run_state(
    rank: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    pickled: dict[str, Any],
    meta: RunMeta,
    goodput: Any | None,
) -> TrainState:
    """One rank's whole train state, the keys `COMPONENT_KEYS` name: the model's and optimizer's
    tensors (DCP-sharded), each of `pickled` ({`KEY_SCHEDULER`/`KEY_PROGRESS`/`KEY_DATA`/`KEY_GUARDS`/
    `KEY_ROLLBACKS`: the live object}, pickled at each snapshot and loaded into in place), the rank's
    RNG states, the run's metadata and, on rank 0 (`goodput` not None), its goodput ledger."""
    state = TrainState(rank)
    state.add(KEY_MODEL, ModelState(model))
    state.add(KEY_OPTIM, OptimizerState(model, optimizer))
    for key, obj in pickled.items():
        state.add(key, Pickled(obj))
    state.add(rng_key(rank), Pickled(RNGState()))
    state.add(KEY_META, meta)
    if goodput is not None:
        state.add(KEY_GOODPUT, Pickled(goodput))
    return state
