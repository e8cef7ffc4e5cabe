"""The `faults:` entries of a config (`FaultSpec`), what kinds and moments exist, and their validation.

What each kind does, and where it fires: `raytrain_ft.resilience.faults` (in the workers) and
`raytrain_ft.launch.start_faults` (at a worker-group start, on the controller).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from raytrain_ft.core.errors import ConfigError

FAULT_KINDS = (
    "raise",
    "kill",
    "nan",
    "spike",
    "bitflip",
    "hang",
    "slow",
    "slow_save",
    "slow_restore",
    "hold_reduce",
    "kill_in_setup",
    "kill_at_launch",
    "kill_at_first_step",
    "freeze",
    "device",
)
FREEZE_MOMENTS = ("start", "reduce", "save")  # raytrain_ft.resilience.faults: where a `freeze` fault stops its rank
# where a `raise` / `kill` fault fires instead of before the step (raytrain_ft.resilience.faults)
FAILURE_MOMENTS = {"raise": ("save",), "kill": ("save", "write", "metadata")}
MAX_SLOW_FACTOR = 100.0  # a `slow` fault slower than this is a hang: use kind hang


@dataclass
class FaultSpec:
    kind: str = MISSING  # one of FAULT_KINDS (raise, kill, nan, ..., kill_in_setup, ...), see faults.py
    step: int = MISSING  # the (first) step at which the fault fires; kill_in_setup/...: the start resuming from >= step
    rank: int = 0  # the rank that fails; -1 = every rank
    steps: int = 1  # spike / nan / slow / device / slow_save / slow_restore: for this many consecutive steps
    factor: float = 1000.0  # spike: the rank's loss (and gradients) x this; slow without seconds: its compute x this
    seconds: float = 0.0  # hang, hold_reduce: once; slow: each step; device: per sequence; slow_save/_restore: each
    at: str = (
        ""  # freeze: start, reduce (default), save; raise: save; kill: save, write, metadata (default: before the step)
    )
    jitter: float = 0.0  # device: each step's wait x (1 + u), u uniform in [-jitter, jitter], seeded by step and rank
    until_members: int = 0  # slow: only in steps with fewer members than this (0: every step of its range)


def validate_faults(faults: list[FaultSpec]) -> None:
    """Raises:
    ConfigError: one line naming the first invalid entry's key and what is valid."""
    for i, f in enumerate(faults):
        if f.kind not in FAULT_KINDS:
            raise ConfigError(f"config key 'faults[{i}].kind' is {f.kind!r}; valid kinds: {', '.join(FAULT_KINDS)}")
        moments = {"freeze": FREEZE_MOMENTS, **FAILURE_MOMENTS}.get(f.kind, ())
        if f.at and f.at not in moments:
            valid = f"valid for {f.kind}: {', '.join(moments)}" if moments else f"{f.kind} takes no 'at'"
            raise ConfigError(f"config key 'faults[{i}].at' is {f.at!r}; {valid}")
        if f.at == "metadata" and f.rank not in (0, -1):
            raise ConfigError(
                f"config key 'faults[{i}].rank' is {f.rank} for a kill at metadata; only rank 0 (the save's "
                "coordinator) writes .metadata: give rank: 0"
            )
        if f.kind == "slow" and not f.seconds > 0 and not 1 < f.factor <= MAX_SLOW_FACTOR:
            raise ConfigError(
                f"config key 'faults[{i}].factor' is {f.factor:g} for a slow fault; give 1 < factor <= "
                f"{MAX_SLOW_FACTOR:g} (the rank's compute takes factor times as long, e.g. factor: 2.0) or seconds"
            )
        if f.kind == "device" and not (f.seconds > 0 and 0 <= f.jitter < 1):
            raise ConfigError(
                f"config keys 'faults[{i}].seconds' ({f.seconds:g}) and 'faults[{i}].jitter' ({f.jitter:g}) of a "
                "device fault need seconds > 0 (the wait per sequence) and 0 <= jitter < 1"
            )
