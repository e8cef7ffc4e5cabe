"""Goodput planner: what a month of training on G GPUs yields, by recovery mode and checkpoint interval.

A vectorised Monte Carlo of one wall-time window (`days`), repeated `repetitions` times with
`numpy.random.default_rng(seed)`; the same seed gives the same failure streams for every interval
and mode (common random numbers), so comparisons between intervals are far less noisy than the
goodput values themselves. All times are in seconds.

Failures: a Poisson process at `gpus / MTBF` (`raytrain_ft.checkpoint.interval.cluster_mtbf_s`), on the
clock of the running job: in `restart` mode the time between failures counts while the job trains,
not while it restarts (by memorylessness that only shifts the next failure; this is also how
`benchmarks/goodput.py` strikes). A `clustered` fraction of failures brings a second one within
the recovery (a node taking its neighbours, a flapping switch): `restart` pays the restart twice,
`replica` loses a second replica.

* `restart` (`failure.recovery: restart`): the job computes `interval_s`, stalls `checkpoint_s`
  for a save, and so on; a save taken at the start of its stall commits `save_s` later (the
  project's async save: `save_s >= checkpoint_s`). A failure loses everything since the snapshot
  of the newest committed checkpoint (`lost_work`), then the group restarts for `restart_s`
  (failure to state restored, `restarts`) and computes again from that checkpoint.
* `replica` (`failure.recovery: replica`, `raytrain_ft.resilience.replicas`): the healthy replicas keep
  training. A failure loses the step in flight (uniform in [0, step_s]: no replica commits it,
  `lost_work`), pauses the survivors for `pause_s` (until the quorum drops the dead replica,
  `restarts`), then the survivors train the whole global batch without the failed replica's share
  (1 / replicas of the throughput) until the replacement joins `rejoin_s` after the failure
  (`degraded_steps`). Committed work is never lost, so a checkpoint only costs its stall here;
  its interval is Daly's, the one `checkpoint.interval: auto` uses (checkpoints guard against
  failures of the whole job, which this model leaves out).

Both modes pay `checkpoint_s` per save (`checkpoint_stalls`). Goodput is the useful compute, at
the full job's throughput, over the wall time; goodput and the four lost parts sum to 1. The
month's last stretch counts as kept (the run goes on, or ends with a final save). Where the model
stops holding: docs/planning.md.

Intervals: `young_s` and `daly_s` are Young's `sqrt(2 C M)` (J. W. Young, "A first order
approximation to the optimum checkpoint interval", CACM 17(9), 1974) and Daly's higher-order
estimate (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", FGCS 22(3), 2006), from `raytrain_ft.checkpoint.interval`; the simulated best interval of `restart`
mode is a search over whole numbers of steps. (`interval.simulate_waste` is the per-period event
loop over a fixed amount of work that checks those formulas; this module simulates a fixed wall
time, with commit latency, clustered failures and both modes, vectorised over repetitions.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from raytrain_ft.checkpoint.interval import cluster_mtbf_s, daly_interval_s, interval_steps, young_interval_s

MODES = ("restart", "replica")
LOST_PARTS = ("lost_work", "restarts", "checkpoint_stalls", "degraded_steps")
SECONDS_PER_DAY = 86_400.0
REPLICA_PAUSE_S = (
    1.0  # the lighthouse's heartbeat timeout (`raytrain_ft.resilience.replicas.LIGHTHOUSE`): the survivors' wait
)
SEARCH_POINTS = 16  # intervals per round of the best-interval search (two rounds), rounded to whole steps


@dataclass(frozen=True)
class Costs:
    """What recovery and checkpoints cost, seconds.

    `checkpoint_s`: the training stall of one save; `save_s`: from the save's start until it is
    committed (at least `checkpoint_s`); `restart_s`: a group restart, from the failure until the
    state is restored; `rejoin_s`: from a replica's failure until its replacement takes part in a
    committed step; `pause_s`: the survivors' wait after a replica's failure; `step_s`: one step.
    """

    checkpoint_s: float
    save_s: float
    restart_s: float
    rejoin_s: float
    step_s: float
    pause_s: float = REPLICA_PAUSE_S

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if not self.step_s > 0 or not self.checkpoint_s > 0:
            raise ValueError(f"step_s and checkpoint_s must be positive, got {self.step_s!r}, {self.checkpoint_s!r}")
        if self.save_s < self.checkpoint_s:
            raise ValueError(f"save_s ({self.save_s} s) is shorter than the stall checkpoint_s ({self.checkpoint_s} s)")


# Documented defaults where neither a flag, a run nor the config gives a cost (docs/planning.md):
# a 5-minute checkpoint (docs/fault-tolerance.md's example), committed when it ends; a 10-minute group restart at
# scale (scheduling, NCCL initialisation, loading); a 5-minute replacement; a 10-second step.
DEFAULT_COSTS = Costs(checkpoint_s=300.0, save_s=300.0, restart_s=600.0, rejoin_s=300.0, step_s=10.0)


@dataclass(frozen=True)
class Cluster:
    """`gpus` GPUs failing independently at `mtbf_hours` each, `gpus_per_replica` per replica
    (`replica` mode; Ray Train 2.60 runs one device per replica), over `days` of wall time, of
    which a `clustered` fraction of failures bring a second one within the recovery."""

    gpus: int
    mtbf_hours: float
    days: float = 30.0
    gpus_per_replica: int = 1
    clustered: float = 0.0

    def __post_init__(self) -> None:
        if not (self.gpus >= 1 and self.mtbf_hours > 0 and self.days > 0 and self.gpus_per_replica >= 1):
            raise ValueError(
                f"gpus, mtbf_hours, days and gpus_per_replica must be positive, got {self.gpus}, "
                f"{self.mtbf_hours}, {self.days}, {self.gpus_per_replica}"
            )
        if not 0.0 <= self.clustered <= 1.0:
            raise ValueError(f"clustered is a fraction of failures in [0, 1], got {self.clustered}")

    @property
    def mtbf_s(self) -> float:
        return cluster_mtbf_s(self.mtbf_hours, self.gpus)

    @property
    def wall_s(self) -> float:
        return self.days * SECONDS_PER_DAY

    @property
    def replicas(self) -> int:
        return self.gpus // self.gpus_per_replica


@dataclass(frozen=True)
class Projection:
    """One mode at one interval: goodput's mean and its 2.5-97.5 % range over the repetitions
    (the month a run gets, 19 times in 20), and the mean fraction of wall time of each lost part."""

    mode: str
    interval_s: float
    goodput: float
    goodput_ci95: tuple[float, float]
    lost: dict[str, float]

    def as_json(self) -> dict:
        return {
            "interval_s": self.interval_s,
            "goodput": self.goodput,
            "goodput_ci95": list(self.goodput_ci95),
            "lost": self.lost,
        }


class Month:
    """The failure streams of `repetitions` months of `cluster`, drawn once from `seed`, on which
    `simulate` runs any mode, costs and interval (common random numbers)."""

    def __init__(self, cluster: Cluster, repetitions: int = 200, seed: int = 0):
        if repetitions < 2:
            raise ValueError(f"repetitions must be at least 2 (for the interval), got {repetitions}")
        self.cluster = cluster
        mean_failures = cluster.wall_s / cluster.mtbf_s
        most = int(mean_failures + 8 * math.sqrt(mean_failures) + 16)  # P(more) < 1e-15 per month
        rng = np.random.default_rng(seed)
        self.gaps = rng.exponential(cluster.mtbf_s, size=(repetitions, most))  # seconds of running between failures
        self.second = rng.random((repetitions, most)) < cluster.clustered  # a second failure within the recovery
        self.in_flight = rng.random((repetitions, most))  # where in its step a failure strikes, [0, 1)

    def simulate(self, mode: str, costs: Costs, interval_s: float) -> Projection:
        """`mode`'s month at a checkpoint every `interval_s` seconds of compute.

        Raises:
            ValueError: an unknown mode, an interval that is not positive, or `replica` mode with
                fewer than 2 replicas (nobody survives a failure: that is `restart`).
        """
        if not interval_s > 0:
            raise ValueError(f"the checkpoint interval must be positive, got {interval_s}")
        if mode == "restart":
            parts = self._restart(costs, interval_s)
        elif mode == "replica":
            parts = self._replica(costs, interval_s)
        else:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        wall = self.cluster.wall_s
        goodput = parts.pop("useful") / wall
        lo, hi = np.percentile(goodput, [2.5, 97.5])
        return Projection(
            mode,
            float(interval_s),
            float(goodput.mean()),
            (float(lo), float(hi)),
            {part: float(parts[part].mean() / wall) for part in LOST_PARTS},
        )

    def _restart(self, c: Costs, tau: float) -> dict[str, np.ndarray]:
        wall = self.cluster.wall_s
        period = tau + c.checkpoint_s
        down = c.restart_s * (1 + self.second)
        start = np.cumsum(self.gaps + down, axis=1) - self.gaps - down  # each running stretch's start
        failed = start + self.gaps <= wall  # stretches ended by a failure within the month
        last = (start < wall) & ~failed  # the stretch the month ends in
        # saves whose snapshot (k tau + (k-1) C) committed save_s later, before the failure
        kept = np.floor((self.gaps + c.checkpoint_s - c.save_s) / period).clip(min=0) * failed
        tail = np.where(last, wall - start, 0.0)  # the last stretch's running time, all of it kept
        tail_useful = np.floor(tail / period) * tau + np.minimum(np.mod(tail, period), tau)
        useful = kept * tau + tail_useful
        stalls = kept * c.checkpoint_s + tail - tail_useful
        lost = np.where(failed, self.gaps, 0.0) - kept * period
        restarts = np.where(failed, np.minimum(down, wall - start - self.gaps), 0.0)
        return {
            "useful": useful.sum(axis=1),
            "lost_work": lost.sum(axis=1),
            "restarts": restarts.sum(axis=1),
            "checkpoint_stalls": stalls.sum(axis=1),
            "degraded_steps": np.zeros(len(self.gaps)),
        }

    def _replica(self, c: Costs, tau: float) -> dict[str, np.ndarray]:
        replicas = self.cluster.replicas
        if replicas < 2:
            raise ValueError(
                f"replica mode needs at least 2 replicas; {self.cluster.gpus} GPUs at "
                f"{self.cluster.gpus_per_replica} per replica is {replicas}"
            )
        wall = self.cluster.wall_s
        failed = np.cumsum(self.gaps, axis=1) <= wall  # the survivors keep the clock running
        events = failed * (1 + self.second)  # replicas lost per failure
        lost = (failed * self.in_flight * c.step_s).sum(axis=1)
        pauses = (events * c.pause_s).sum(axis=1)
        training = wall - lost - pauses
        degraded = (events * max(c.rejoin_s - c.pause_s, 0.0) / replicas).sum(axis=1)
        stalls = training * c.checkpoint_s / (tau + c.checkpoint_s)
        return {
            "useful": training - stalls - degraded,
            "lost_work": lost,
            "restarts": pauses,
            "checkpoint_stalls": stalls,
            "degraded_steps": degraded,
        }

    def best_restart(self, costs: Costs) -> Projection:
        """`restart` mode at its best interval: the highest mean goodput over `SEARCH_POINTS`
        log-spaced intervals from one step (or the save's commit latency, if longer: shorter
        intervals queue writes) to 30 x Daly's, then as many between the best one's neighbours,
        each rounded to whole steps."""
        daly = daly_interval_s(costs.checkpoint_s, self.cluster.mtbf_s)
        lo = max(costs.step_s, costs.save_s - costs.checkpoint_s)
        grid = np.geomspace(lo, max(lo, min(30 * daly, self.cluster.wall_s)), SEARCH_POINTS)
        tried: dict[int, Projection] = {}

        def best_of(intervals: np.ndarray) -> int:
            for n in {interval_steps(t, costs.step_s) for t in intervals} - tried.keys():
                tried[n] = self.simulate("restart", costs, n * costs.step_s)
            return int(np.argmax([tried[interval_steps(t, costs.step_s)].goodput for t in intervals]))

        b = best_of(grid)
        best_of(np.geomspace(grid[max(b - 1, 0)], grid[min(b + 1, len(grid) - 1)], SEARCH_POINTS))
        return max(tried.values(), key=lambda p: p.goodput)


def daly_steps_s(costs: Costs, mtbf_s: float) -> float:
    """Daly's interval in seconds, rounded to whole steps (as `checkpoint.interval: auto` plans it,
    never shorter than one save)."""
    interval = max(daly_interval_s(costs.checkpoint_s, mtbf_s), costs.save_s)
    return interval_steps(interval, costs.step_s) * costs.step_s


def plan(
    cluster: Cluster,
    costs: Costs,
    modes: tuple[str, ...] = MODES,
    interval_s: float | None = None,
    repetitions: int = 200,
    seed: int = 0,
) -> dict:
    """The planner's answer: `{"young_s", "daly_s", "modes": {mode: Projection.as_json()}}`.

    `interval_s` None: `restart` at its simulated best interval (`Month.best_restart`), `replica`
    at Daly's (`daly_steps_s`). Deterministic given `seed`.
    """
    month = Month(cluster, repetitions, seed)
    out: dict = {
        "young_s": young_interval_s(costs.checkpoint_s, cluster.mtbf_s),
        "daly_s": daly_interval_s(costs.checkpoint_s, cluster.mtbf_s),
        "modes": {},
    }
    for mode in modes:
        if interval_s is not None:
            p = month.simulate(mode, costs, interval_s)
        elif mode == "restart":
            p = month.best_restart(costs)
        else:
            p = month.simulate(mode, costs, daly_steps_s(costs, cluster.mtbf_s))
        out["modes"][mode] = p.as_json()
    return out


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
        metrics: metric histories by key: `train/step_time_s` (median: `step_s`),
            `checkpoint_cost_s` and `checkpoint_save_s` (means: `checkpoint_s`, `save_s`; logged
            under `checkpoint.interval: auto`), else the positive `train/checkpoint_stall_s` (mean: `checkpoint_s`).
        steps_done: (step, unix seconds) of every completed step (`tracking.steps_logged_since`).

    `restart_s` is the median failure-to-restored time of the group restarts
    (`recovery.recovery_rows`' `restored_s`), `rejoin_s` the median of the replacements'
    `replacement_joined_s` and `pause_s` the median `survivors_pause_s` (`recovery.replacement_rows`;
    the replicas: the `participants` of the step the replacement joined).
    """
    import statistics

    from raytrain_ft.resilience.recovery import recovery_rows, replacement_rows

    out: dict[str, float] = {}
    if metrics.get("train/step_time_s"):
        out["step_s"] = statistics.median(metrics["train/step_time_s"])
    stalls = metrics.get("checkpoint_cost_s") or [s for s in metrics.get("train/checkpoint_stall_s", []) if s > 0]
    if stalls:
        out["checkpoint_s"] = statistics.mean(stalls)
    if metrics.get("checkpoint_save_s"):
        out["save_s"] = statistics.mean(metrics["checkpoint_save_s"])
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


def config_interval_s(checkpoint_interval: str, interval_steps_: int, costs: Costs, mtbf_s: float) -> float:
    """The checkpoint interval a config runs with, seconds: `checkpoint.interval_steps` steps of
    `costs.step_s` (`fixed`), or Daly's interval in whole steps (`auto`, `daly_steps_s`)."""
    if checkpoint_interval == "auto":
        return daly_steps_s(costs, mtbf_s)
    return interval_steps_ * costs.step_s
