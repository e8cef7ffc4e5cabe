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
* The memory tier (`checkpoint.memory`, on when `memory_checkpoint_s > 0`; `restart` mode only,
  as the config allows: replicas heal from a live peer): between two durable saves a memory save
  every `memory_steps_s` of compute (Daly's interval from its stall, as
  `checkpoint.memory.interval: auto` plans it), each stalling `memory_checkpoint_s` and
  committing `memory_save_s` after its start (local copy and peer copy verified). The memory
  clock starts at each durable save, and a memory save that would fall on a durable save is
  skipped (the durable save's stall takes the same snapshot; one stall, not two): `Schedule`. The
  loop (`raytrain_ft.training.loop`) also takes only the durable save at a step where both are due, but its
  memory clock does not restart at durable saves (under `checkpoint.memory.interval: auto` the
  memory save comes a step later): at most one memory save per durable interval apart. A
  failure loses the work since the newest committed checkpoint of either tier. A restore from
  memory is faster than one from storage, but `restart_s` stays the one restart figure: pass
  what the runs measured. `replica` mode ignores the tier (the config refuses it with replica
  recovery). With the tier on, `plan` puts `restart`'s durable saves at Daly's interval rather
  than searching it. Failures of a node and its peer together or of the whole cluster, which
  take a memory copy and its peer copy at once, are left out: the memory tier is assumed to
  survive every failure the model draws.

Both modes pay `checkpoint_s` per durable save, `restart` also `memory_checkpoint_s` per memory
save (`checkpoint_stalls`); a stretch after a restart starts both tiers' clocks afresh. Goodput
is the useful compute, at the full job's throughput, over the wall time; goodput and the four
lost parts sum to 1. The month's last stretch counts as kept (the run goes on, or ends with a final save).
Where the model stops holding: docs/planning.md.

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
from dataclasses import dataclass

import numpy as np

from raytrain_ft.checkpoint.interval import cluster_mtbf_s, daly_interval_s, interval_steps, young_interval_s
from raytrain_ft.resilience.planner_costs import DEFAULT_COSTS as DEFAULT_COSTS  # re-exported: the planner's API
from raytrain_ft.resilience.planner_costs import REPLICA_PAUSE_S as REPLICA_PAUSE_S
from raytrain_ft.resilience.planner_costs import Costs
from raytrain_ft.resilience.planner_costs import measured_costs as measured_costs
from raytrain_ft.resilience.planner_costs import survivors_pause_s as survivors_pause_s

MODES = ("restart", "replica")
LOST_PARTS = ("lost_work", "restarts", "checkpoint_stalls", "degraded_steps")
SECONDS_PER_DAY = 86_400.0
SEARCH_POINTS = 16  # intervals per round of the best-interval search (two rounds), rounded to whole steps


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
    memory_interval_s: float | None = None  # the memory tier's interval; None: the tier is off

    def as_json(self) -> dict:
        out = {
            "interval_s": self.interval_s,
            "goodput": self.goodput,
            "goodput_ci95": list(self.goodput_ci95),
            "lost": self.lost,
        }
        if self.memory_interval_s is not None:
            out["memory_interval_s"] = self.memory_interval_s
        return out


@dataclass(frozen=True)
class Schedule:
    """Where the saves fall in a stretch of running that starts at a restored checkpoint, vectorised
    over stretch lengths `running` (seconds). A durable period is `tau` of compute and a durable
    stall; with the memory tier on, a memory save every `memory_tau` of compute counted from the
    period's start, `memories` of them before the durable save (none falls on or after it: that
    one is the durable save). Each save's snapshot is taken as its stall starts; a save commits
    `save` (`memory_save`) after its snapshot. Times in seconds."""

    tau: float
    stall: float
    save: float
    memory_tau: float  # `tau` when the tier is off (with no memories)
    memory_stall: float = 0.0
    memory_save: float = 0.0
    memories: int = 0

    @classmethod
    def of(cls, c: Costs, tau: float, memory_tau: float | None) -> Schedule:
        if memory_tau is None:
            return cls(tau, c.checkpoint_s, c.save_s, tau)
        # the memory saves strictly before the durable one (rounded: 4,200 s over 600 s is 6, not 7)
        memories = max(math.ceil(round(tau / memory_tau, 9)) - 1, 0)
        return cls(tau, c.checkpoint_s, c.save_s, memory_tau, c.memory_checkpoint_s, c.memory_save_s, memories)

    @property
    def period(self) -> float:
        return self.tau + self.memories * self.memory_stall + self.stall

    @property
    def period_stalls(self) -> float:
        return self.memories * self.memory_stall + self.stall

    def kept(self, running: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(compute, stalls, wall time to the end of its stall) of the newest checkpoint of either
        tier committed within `running` (0 where none is)."""
        d = np.floor((running + self.stall - self.save) / self.period).clip(min=0)  # durable saves committed
        done, stalls, wall = d * self.tau, d * self.period_stalls, d * self.period
        if not self.memories:
            return done, stalls, wall
        q = self.memory_tau + self.memory_stall  # a memory save's compute and stall
        t = running - self.memory_save  # memory snapshots up to t have committed: the newest is save i of period k
        k = np.floor(t / self.period)
        i = np.minimum(np.floor((t - k * self.period + self.memory_stall) / q), self.memories)
        k, i = np.where(i > 0, k, k - 1), np.where(i > 0, i, self.memories)  # i = 0: the previous period's last
        m_wall = k * self.period + i * q
        newer = (k >= 0) & (m_wall - self.memory_stall > wall - self.stall)
        return (
            np.where(newer, k * self.tau + i * self.memory_tau, done),
            np.where(newer, k * self.period_stalls + i * self.memory_stall, stalls),
            np.where(newer, m_wall, wall),
        )

    def compute(self, running: np.ndarray) -> np.ndarray:
        """The compute done in `running` seconds without a failure."""
        whole, rest = np.floor(running / self.period) * self.tau, np.mod(running, self.period)
        if not self.memories:
            return whole + np.minimum(rest, self.tau)
        q, last = self.memory_tau + self.memory_stall, self.tau - self.memories * self.memory_tau
        i = np.minimum(np.floor(rest / q), self.memories)
        return (
            whole + i * self.memory_tau + np.minimum(rest - i * q, np.where(i < self.memories, self.memory_tau, last))
        )


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
        """`mode`'s month at a durable checkpoint every `interval_s` seconds of compute (and, with
        the memory tier on, `restart` mode a memory checkpoint every `memory_steps_s`).

        Raises:
            ValueError: an unknown mode, an interval that is not positive, or `replica` mode with
                fewer than 2 replicas (nobody survives a failure: that is `restart`).
        """
        if not interval_s > 0:
            raise ValueError(f"the checkpoint interval must be positive, got {interval_s}")
        # replica: the model draws single replicas lost, healed from a live peer (no tier)
        memory_s = memory_steps_s(costs, self.cluster.mtbf_s) if mode == "restart" else None
        schedule = Schedule.of(costs, interval_s, memory_s)
        if mode == "restart":
            parts = self._restart(costs, schedule)
        elif mode == "replica":
            parts = self._replica(costs, schedule)
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
            memory_s,
        )

    def _restart(self, c: Costs, schedule: Schedule) -> dict[str, np.ndarray]:
        wall = self.cluster.wall_s
        down = c.restart_s * (1 + self.second)
        start = np.cumsum(self.gaps + down, axis=1) - self.gaps - down  # each running stretch's start
        failed = start + self.gaps <= wall  # stretches ended by a failure within the month
        last = (start < wall) & ~failed  # the stretch the month ends in
        # the newest checkpoint whose snapshot committed (save_s later) before the failure
        kept_compute, kept_stalls, kept_wall = (np.where(failed, x, 0.0) for x in schedule.kept(self.gaps))
        tail = np.where(last, wall - start, 0.0)  # the last stretch's running time, all of it kept
        tail_useful = schedule.compute(tail)
        useful = kept_compute + tail_useful
        stalls = kept_stalls + tail - tail_useful
        lost = np.where(failed, self.gaps - kept_wall, 0.0)
        restarts = np.where(failed, np.minimum(down, wall - start - self.gaps), 0.0)
        return {
            "useful": useful.sum(axis=1),
            "lost_work": lost.sum(axis=1),
            "restarts": restarts.sum(axis=1),
            "checkpoint_stalls": stalls.sum(axis=1),
            "degraded_steps": np.zeros(len(self.gaps)),
        }

    def _replica(self, c: Costs, schedule: Schedule) -> dict[str, np.ndarray]:
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
        stalls = training * schedule.period_stalls / schedule.period
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


def memory_steps_s(costs: Costs, mtbf_s: float) -> float | None:
    """The memory tier's interval in seconds: Daly's from its stall, never shorter than its save,
    rounded to whole steps (as `checkpoint.memory.interval: auto` plans it); None when off."""
    if not costs.memory_tier:
        return None
    interval = max(daly_interval_s(costs.memory_checkpoint_s, mtbf_s), costs.memory_save_s)
    return interval_steps(interval, costs.step_s) * costs.step_s


def plan(
    cluster: Cluster,
    costs: Costs,
    modes: tuple[str, ...] = MODES,
    interval_s: float | None = None,
    repetitions: int = 200,
    seed: int = 0,
) -> dict:
    """The planner's answer: `{"young_s", "daly_s", "modes": {mode: Projection.as_json()}}`, and
    `"memory_daly_s"` (Daly's interval from the memory stall) with the memory tier on.

    `interval_s` None: `restart` at its simulated best interval (`Month.best_restart`) with the
    memory tier off, at Daly's with it on (the search would stretch it to its end: within the model
    the memory tier guards every failure, so durable saves only cost), `replica` at Daly's
    (`daly_steps_s`). Deterministic given `seed`.
    """
    month = Month(cluster, repetitions, seed)
    out: dict = {
        "young_s": young_interval_s(costs.checkpoint_s, cluster.mtbf_s),
        "daly_s": daly_interval_s(costs.checkpoint_s, cluster.mtbf_s),
        "modes": {},
    }
    if costs.memory_tier:
        out["memory_daly_s"] = daly_interval_s(costs.memory_checkpoint_s, cluster.mtbf_s)
    for mode in modes:
        if interval_s is not None:
            p = month.simulate(mode, costs, interval_s)
        elif mode == "restart" and not costs.memory_tier:
            p = month.best_restart(costs)
        else:
            p = month.simulate(mode, costs, daly_steps_s(costs, cluster.mtbf_s))
        out["modes"][mode] = p.as_json()
    return out


def config_interval_s(checkpoint_interval: str, interval_steps_: int, costs: Costs, mtbf_s: float) -> float:
    """The checkpoint interval a config runs with, seconds: `checkpoint.interval_steps` steps of
    `costs.step_s` (`fixed`), or Daly's interval in whole steps (`auto`, `daly_steps_s`)."""
    if checkpoint_interval == "auto":
        return daly_steps_s(costs, mtbf_s)
    return interval_steps_ * costs.step_s
