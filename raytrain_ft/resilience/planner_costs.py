"""What recovery and checkpoints cost the goodput planner (`raytrain_ft.resilience.planner`), and where
the figures come from: the flags, a finished run's measurements (`measured_costs`) or `DEFAULT_COSTS`.

Two checkpoint tiers: durable checkpoints (object storage, `checkpoint_s` / `save_s`) and, when
`memory_checkpoint_s` is positive, the memory tier (`checkpoint.memory`: each rank's state in its
node's memory with a copy on another node, `memory_checkpoint_s` / `memory_save_s`). All times are
in seconds.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

REPLICA_PAUSE_S = (
    1.0  # the lighthouse's heartbeat timeout (`raytrain_ft.resilience.replicas.LIGHTHOUSE`): the survivors' wait
)


@dataclass(frozen=True)
class Costs:
    """What recovery and checkpoints cost, seconds.

    `checkpoint_s`: the training stall of one durable save; `save_s`: from the save's start until it
    is committed (at least `checkpoint_s`); `restart_s`: a group restart, from the failure until the
    state is restored (from either tier: one figure, the one measured); `rejoin_s`: from a replica's
    failure until its replacement takes part in a committed step; `pause_s`: the survivors' wait
    after a replica's failure; `step_s`: one step. `memory_checkpoint_s`: the training stall of one
    memory-tier save, 0 when the tier is off; `memory_save_s`: from its start until committed (the
    local copy and the peer copy verified; at least `memory_checkpoint_s`).
    """

    checkpoint_s: float
    save_s: float
    restart_s: float
    rejoin_s: float
    step_s: float
    pause_s: float = REPLICA_PAUSE_S
    memory_checkpoint_s: float = 0.0
    memory_save_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if not self.step_s > 0 or not self.checkpoint_s > 0:
            raise ValueError(f"step_s and checkpoint_s must be positive, got {self.step_s!r}, {self.checkpoint_s!r}")
        if self.save_s < self.checkpoint_s:
            raise ValueError(f"save_s ({self.save_s} s) is shorter than the stall checkpoint_s ({self.checkpoint_s} s)")
        if self.memory_save_s < self.memory_checkpoint_s:
            raise ValueError(
                f"memory_save_s ({self.memory_save_s} s) is shorter than the stall memory_checkpoint_s "
                f"({self.memory_checkpoint_s} s)"
            )
        if self.memory_save_s > 0 and not self.memory_tier:
            raise ValueError(
                f"memory_save_s ({self.memory_save_s} s) without a memory stall: memory_checkpoint_s 0 is the tier off"
            )

    @property
    def memory_tier(self) -> bool:
        """Whether the memory tier is on (a positive `memory_checkpoint_s`)."""
        return self.memory_checkpoint_s > 0


# Documented defaults where neither a flag, a run nor the config gives a cost (docs/planning.md):
# a 5-minute checkpoint (docs/fault-tolerance.md's example), committed when it ends; a 10-minute group restart at
# scale (scheduling, NCCL initialisation, loading); a 5-minute replacement; a 10-second step; no memory tier.
DEFAULT_COSTS = Costs(checkpoint_s=300.0, save_s=300.0, restart_s=600.0, rejoin_s=300.0, step_s=10.0)

# metric -> `Costs` field, the mean over its history (logged per save; the durable pair under
# `checkpoint.interval: auto`, the memory pair by the memory tier)
MEAN_METRICS = {
    "checkpoint_cost_s": "checkpoint_s",
    "checkpoint_save_s": "save_s",
    "memory_checkpoint_cost_s": "memory_checkpoint_s",
    "memory_checkpoint_save_s": "memory_save_s",
}


def survivors_pause_s(survivors_committed_s: float, step_s: float, replicas: int) -> float:
    """The survivors' pause after a replica's failure, seconds, from the time until they committed
    a step again (`raytrain_ft.resilience.recovery.replacement_rows`' `survivors_committed_s`): minus that
    step, which trains the whole global batch on `replicas - 1` replicas (`step_s` x replicas /
    (replicas - 1) long). Never below 0."""
    if replicas < 2:
        raise ValueError(f"replica recovery needs at least 2 replicas, got {replicas}")
    return max(0.0, survivors_committed_s - step_s * replicas / (replicas - 1))


def measured_costs(
    events: list[dict], metrics: dict[str, list[float]], steps_done: list[tuple[int, float]]
) -> dict[str, float]:
    """The `Costs` fields a finished run measured, seconds (those it did not measure are absent).

    Args:
        events: the run's events (`tracking.MlflowRecorder.events()`).
        metrics: metric histories by key: `train/step_time_s` (median: `step_s`), the `MEAN_METRICS`
            (means: `checkpoint_s`, `save_s`, `memory_checkpoint_s`, `memory_save_s`); without
            `checkpoint_cost_s`, the positive `train/checkpoint_stall_s` (mean: `checkpoint_s`).
        steps_done: (step, unix seconds) of every completed step (`tracking.steps_logged_since`).

    `restart_s` is the median failure-to-restored time of the group restarts
    (`recovery.recovery_rows`' `restored_s`), `rejoin_s` the median of the replacements'
    `replacement_joined_s` and `pause_s` the median `survivors_pause_s` (`recovery.replacement_rows`;
    the replicas: the `participants` of the step the replacement joined).
    """
    from raytrain_ft.resilience.recovery import recovery_rows, replacement_rows

    out: dict[str, float] = {}
    if metrics.get("train/step_time_s"):
        out["step_s"] = statistics.median(metrics["train/step_time_s"])
    for key, field in MEAN_METRICS.items():
        if metrics.get(key):
            out[field] = statistics.mean(metrics[key])
    stalls = [s for s in metrics.get("train/checkpoint_stall_s", []) if s > 0]
    if stalls and "checkpoint_s" not in out:
        out["checkpoint_s"] = statistics.mean(stalls)
    restored = [r["restored_s"] for r in recovery_rows(events) if r["restored_s"] is not None]
    if restored:
        out["restart_s"] = statistics.median(restored)
    rows = replacement_rows(events, steps_done)
    joined = [r["replacement_joined_s"] for r in rows if r["replacement_joined_s"] is not None]
    if joined:
        out["rejoin_s"] = statistics.median(joined)
    committed = [  # replicas: those in the step the replacement joined (all of them again)
        (r["survivors_committed_s"], r["participants"])
        for r in rows
        if r["survivors_committed_s"] is not None and (r["participants"] or 0) >= 2
    ]
    if committed and "step_s" in out:
        out["pause_s"] = statistics.median(survivors_pause_s(t, out["step_s"], p) for t, p in committed)
    return out
