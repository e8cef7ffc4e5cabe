"""Reading a run config: one YAML file plus dotted overrides, checked against the schema
(`raytrain_ft.core.config`) and for values that cannot work together.

`load_config("configs/tiny.yaml", ["train.max_steps=40"])` merges, in order, the dataclass
defaults, the YAML file and the overrides (OmegaConf structured configs), then builds the typed
`Config`. An unknown key or a value of the wrong type raises `ConfigError` with one line that
names the key and, for unknown keys, the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import cast

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from raytrain_ft.core.config import (
    ALERT_POLICIES,
    GPU_TYPES,
    INTERVAL_MODES,
    LR_SCHEDULES,
    RECOVERY_MODES,
    STRAGGLER_ACTIONS,
    STRATEGIES,
    Config,
    TrainSection,
    valid_keys,
)
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.core.fault_spec import validate_faults


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Build a validated `Config` from an optional YAML file and `key=value` overrides.

    Raises:
        ConfigError: unknown key, wrong type, unreadable file or inconsistent values.
    """
    for o in overrides or []:
        if "=" not in o:
            raise ConfigError(f"override '{o}' has no value; write it as {o}=VALUE")
    try:
        sources = [OmegaConf.load(path)] if path is not None else []
        sources.append(OmegaConf.from_dotlist(list(overrides or [])))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found; pass an existing YAML file to --config") from None
    except (OSError, yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot read config {path or 'overrides'}: {str(e).splitlines()[0]}") from None
    return _build(sources)


def _build(sources: list) -> Config:
    try:
        cfg = cast(Config, OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), *sources)))
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e)) from None
    except (TypeError, ValueError) as e:  # e.g. a YAML list where a mapping belongs
        raise ConfigError(f"config has the wrong shape: {str(e).splitlines()[0]}") from None
    _validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    """Plain nested dict (for Ray's train_loop_config and MLflow params)."""
    return cast(dict, OmegaConf.to_container(OmegaConf.structured(cfg)))


def from_dict(d: dict) -> Config:
    """Inverse of `to_dict` (used by workers to rebuild the typed config)."""
    return _build([OmegaConf.create(d)])


def _describe(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).splitlines()[0]
    if "not in" in msg or "Key" in msg and "not" in msg:
        sections = sorted({k.split(".")[0] + "." for k in valid_keys() if "." in k})  # 'trian.x=1' fails at 'trian'
        close = difflib.get_close_matches(key if "." in key else key + ".", valid_keys() + sections, n=1, cutoff=0.5)
        if close and close[0].endswith("."):
            return f"unknown config section '{key}'; did you mean '{close[0][:-1]}'?"
        hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(valid_keys())}"
        return f"unknown config key '{key}'{hint}"
    if "Missing mandatory value" in msg:
        return f"config key '{key}' is required but missing"
    return f"config key '{key}': {msg}"


def _validate(cfg: Config) -> None:
    n = cfg.scaling.num_workers
    elastic_ok = isinstance(n, list) and len(n) == 2 and all(isinstance(x, int) for x in n) and 1 <= n[0] <= n[1]
    if not (isinstance(n, int) and n >= 1) and not elastic_ok:
        raise ConfigError(f"config key 'scaling.num_workers' must be a positive int or [min, max], got {n!r}")
    validate_faults(cfg.faults)
    spike = cfg.guards.spike
    if not 1 <= spike.warmup <= spike.window:
        raise ConfigError(
            f"config keys 'guards.spike.warmup' ({spike.warmup}) and 'guards.spike.window' ({spike.window}) need "
            "1 <= warmup <= window, or the history never gets long enough to judge a spike"
        )
    if cfg.guards.on_alert not in ALERT_POLICIES:
        raise ConfigError(
            f"config key 'guards.on_alert' is {cfg.guards.on_alert!r}; valid: {', '.join(ALERT_POLICIES)}"
        )
    if cfg.parallel.strategy not in STRATEGIES:
        raise ConfigError(
            f"config key 'parallel.strategy' is {cfg.parallel.strategy!r}; valid: {', '.join(STRATEGIES)}"
        )
    if cfg.scaling.gpu_type not in GPU_TYPES:
        raise ConfigError(f"config key 'scaling.gpu_type' is {cfg.scaling.gpu_type!r}; valid: {', '.join(GPU_TYPES)}")
    for key in ("interval_steps", "num_batches"):
        if getattr(cfg.validation, key) < 0:
            raise ConfigError(f"config key 'validation.{key}' must be >= 0, got {getattr(cfg.validation, key)}")
    if cfg.failure.recovery not in RECOVERY_MODES:
        raise ConfigError(
            f"config key 'failure.recovery' is {cfg.failure.recovery!r}; valid: {', '.join(RECOVERY_MODES)}"
        )
    st = cfg.straggler
    if st.action not in STRAGGLER_ACTIONS:
        raise ConfigError(f"config key 'straggler.action' is {st.action!r}; valid: {', '.join(STRAGGLER_ACTIONS)}")
    if not st.threshold > 1 or not 1 <= st.min_slow_steps <= st.window:
        raise ConfigError(
            f"config keys 'straggler.threshold' ({st.threshold:g}), 'straggler.min_slow_steps' ({st.min_slow_steps}) "
            f"and 'straggler.window' ({st.window}) need threshold > 1 and 1 <= min_slow_steps <= window"
        )
    if st.exclude_after_steps < 0:
        raise ConfigError(f"config key 'straggler.exclude_after_steps' must be >= 0, got {st.exclude_after_steps}")
    if st.probe_every_steps < 1:
        raise ConfigError(f"config key 'straggler.probe_every_steps' must be >= 1, got {st.probe_every_steps}")
    if cfg.checkpoint.interval not in INTERVAL_MODES:
        raise ConfigError(
            f"config key 'checkpoint.interval' is {cfg.checkpoint.interval!r}; valid: {', '.join(INTERVAL_MODES)}"
        )
    _validate_schedule(cfg.train)
    _validate_memory_tier(cfg)
    if not cfg.failure.liveness_timeout_s > 0:
        raise ConfigError(f"config key 'failure.liveness_timeout_s' must be > 0, got {cfg.failure.liveness_timeout_s}")
    if not (cfg.failure.hang_timeout_s >= 0 and cfg.failure.start_timeout_s > 0):
        raise ConfigError(
            f"config keys 'failure.hang_timeout_s' ({cfg.failure.hang_timeout_s}) and 'failure.start_timeout_s' "
            f"({cfg.failure.start_timeout_s}) need hang_timeout_s >= 0 (0: auto) and start_timeout_s > 0"
        )
    if not cfg.failure.mtbf_hours_per_gpu > 0:
        raise ConfigError(f"config key 'failure.mtbf_hours_per_gpu' must be > 0, got {cfg.failure.mtbf_hours_per_gpu}")
    for key, value in dataclasses.asdict(cfg.waits).items():
        if not value > 0:
            raise ConfigError(f"config key 'waits.{key}' must be > 0 (seconds), got {value}")
    positive = {
        "train.max_steps": cfg.train.max_steps,
        "train.global_batch_size": cfg.train.global_batch_size,
        "train.micro_batch_size": cfg.train.micro_batch_size,
        "checkpoint.interval_steps": cfg.checkpoint.interval_steps,
        "scaling.gpus_per_node": cfg.scaling.gpus_per_node,
        "checkpoint.num_to_keep": cfg.checkpoint.num_to_keep,
        "guards.rank_check.interval_steps": cfg.guards.rank_check.interval_steps,
        "guards.fingerprint.interval_steps": cfg.guards.fingerprint.interval_steps,
        "guards.spike.max_consecutive_skips": cfg.guards.spike.max_consecutive_skips,
        "failure.group_start_timeout_s": cfg.failure.group_start_timeout_s,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {value}")


def _validate_memory_tier(cfg: Config) -> None:
    m = cfg.checkpoint.memory
    if m.interval not in INTERVAL_MODES:
        raise ConfigError(
            f"config key 'checkpoint.memory.interval' is {m.interval!r}; valid: {', '.join(INTERVAL_MODES)}"
        )
    if m.interval_steps < 0 or m.peer_copies < 0 or m.max_bytes_per_node < 0:
        raise ConfigError(
            "config keys 'checkpoint.memory.interval_steps', '.peer_copies' and '.max_bytes_per_node' must be >= 0"
        )
    if m.interval == "auto" and m.interval_steps < 1:
        raise ConfigError(
            "config key 'checkpoint.memory.interval_steps' must be >= 1 with interval: auto (the first save)"
        )


def _validate_schedule(t: TrainSection) -> None:
    if t.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"config key 'train.lr_schedule' is {t.lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
    if t.lr_schedule == "wsd" and not 1 <= t.decay_steps <= t.max_steps - t.warmup_steps:
        raise ConfigError(
            f"config key 'train.decay_steps' is {t.decay_steps} but train.lr_schedule=wsd needs 1 <= decay_steps <= "
            f"max_steps - warmup_steps ({t.max_steps - t.warmup_steps}); about 20% of max_steps is usual"
        )
