"""Worker-group starts that leave nothing behind: the adapter between Ray Train 2.60's group start and
Ray's public placement-group API.

Ray Train 2.60 builds a worker group's state (its placement group, worker actors and synchronization
actor) before the setup callbacks run (the process group, Ray's placement-group cleaner, datasets) and
before it launches the train function (`WorkerGroup._start_impl`). A worker that dies after that
point makes `WorkerGroup.create` raise, and `WorkerGroup._start` cleans up only a group that has not
reached that point (`if not self.has_started()`): the controller never holds the half-started group,
so nothing removes it. Its placement group is not detached, so it lives as long as the driver's job;
Ray's placement-group cleaner learns a group only once the setup is done. Two such leftovers at
exact fit hold every CPU, and each later start waits `RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S` for a
placement group that cannot be placed, again and again (a start timeout is a controller failure,
unlimited by default).

`StartCleaner` closes that gap with Ray's public calls (`ray.kill`, `ray.util.remove_placement_group`,
`ray.util.placement_group_table`, `ray.available_resources`): it remembers what each start created
before the setup runs (`before_init_train_context`, the one hook that runs before it whatever the
callbacks' order), forgets it once the start completed (the controller's move to `RunningState`, after
`WorkerGroup.create` returned and every start callback ran: from then on the controller holds the group
and shuts it down itself), and removes a start that did not complete
before the next start (`on_controller_start_worker_group`: Ray's own retry) and when the controller
ends (`before_controller_shutdown`: the driver's resume, `driver.failed_during_group_start`). Removing
a placement group kills the actors placed in it; the synchronization actor holds no resources and
ends with the controller.

At every start it then records a `group_start` event: the cluster's free resources, the job's baseline
(free when the driver started, `baseline_resources`), this run's placement groups still alive and
what it removed. Resources a removed group held come back in the cluster's view with a delay (the
raylet first stops the actors placed there); a start that needs them waits until the cluster's free
resources cover the group (or are back to the baseline), at most `RELEASE_WAIT_S` and only while the
cluster has them at all; then it logs one line (what it needs, what is free) and goes on:
the placement group's wait, `failure.group_start_timeout_s`, bounds the rest.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, remove_placement_group

from raytrain_ft.launch.ray_internals import ControllerCallback, RunningState, WorkerGroupCallback
from raytrain_ft.launch.recorder_actor import RemoteRecorder

log = logging.getLogger(__name__)

RELEASE_WAIT_S = 5.0  # a start waits at most this long for released resources to show as free
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train's placement-group wait per start


def baseline_resources() -> dict[str, float]:
    """The cluster's free resources now ({name: amount}; CPU, GPU, memory in bytes, ...) without Ray's
    per-node labels (`node:<ip>`): what the driver records before the run's first group start."""
    return {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}


def short(free: dict[str, float]) -> dict[str, float]:
    """The CPU and GPU of a resource dict, rounded: what the `group_start` event and its lines name."""
    return {k: round(free.get(k, 0.0), 4) for k in ("CPU", "GPU") if k in free or k == "CPU"}


@dataclass
class StartLeftovers:
    """What one worker-group start created before its setup: worker actors and their placement group."""

    actors: list = field(default_factory=list)
    placement_group: str | None = None  # hex id


class StartCleaner(ControllerCallback, WorkerGroupCallback):
    """Runs on the controller: removes what a worker-group start that did not complete left behind,
    before the next start and when the controller ends, and records a `group_start` event at each start
    (see the module docstring). `baseline`: the cluster's free resources when the driver started
    (`baseline_resources`)."""

    def __init__(self, recorder_actor: ray.actor.ActorHandle, baseline: dict[str, float]):
        self.recorder_actor, self.baseline = recorder_actor, baseline
        self.starting: StartLeftovers | None = None  # the start in progress, until it completes

    def before_worker_group_start(self, worker_group_context) -> None:
        self.starting = StartLeftovers()

    def before_init_train_context(self, workers) -> dict:
        # A whole group's start (a replica replacement starts no worker group: not ours to track)
        if self.starting is not None and workers:
            self.starting.actors = [w.actor for w in workers]
            # Ray's own function runs in the worker, where `ray.util` is loaded: a function of ours would
            # make the worker import its module (and torch, through `ray_internals`) while the
            # controller waits, before the workers' setup, which imports in parallel (1.5-1.9 s a start)
            pg = ray.get(workers[0].execute_async(get_current_placement_group))
            self.starting.placement_group = pg.id.hex() if pg is not None else None
        return {}

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if isinstance(current_state, RunningState):  # WorkerGroup.create returned: the controller holds it
            self.starting = None

    def on_controller_start_worker_group(self, *, scaling_config, num_workers: int):
        removed = self.remove_leftovers()
        per_worker = scaling_config.resources_per_worker or {}
        needs = {k: v * num_workers for k, v in per_worker.items() if k in ("CPU", "GPU")}
        free = self.wait_for_release(needs)
        alive = [pg for pg, info in ray.util.placement_group_table().items() if info["state"] != "REMOVED"]
        if not covers(free, needs):
            log.warning(
                "group start: %d workers need %s, the cluster has %s free (%s when the job started); "
                "the placement group waits at most %g s (failure.group_start_timeout_s)",
                num_workers,
                needs,
                short(free),
                short(self.baseline),
                start_timeout_s(),
            )
        try:
            RemoteRecorder(self.recorder_actor).event(
                "group_start",
                num_workers=num_workers,
                needs=needs,
                free=short(free),
                baseline=short(self.baseline),
                placement_groups=alive,
                removed=removed,
            )
        except Exception as e:  # telemetry never decides a start
            log.warning("group_start not recorded: %s", e)
        return None

    async def before_controller_shutdown(self) -> None:
        self.remove_leftovers()

    def remove_leftovers(self) -> list[str]:
        """Kill the worker actors and remove the placement group of a start that did not complete;
        return the removed placement groups' ids (empty when there was none)."""
        leftovers, self.starting = self.starting, None
        if leftovers is None:
            return []
        for actor in leftovers.actors:
            ray.kill(actor, no_restart=True)
        if leftovers.placement_group is None:
            return []
        pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(leftovers.placement_group)))
        if ray.util.placement_group_table(pg).get("state", "REMOVED") != "REMOVED":
            remove_placement_group(pg)
            log.warning(
                "group start: removed placement group %s and %d worker actors of a start that did not complete",
                leftovers.placement_group,
                len(leftovers.actors),
            )
            return [leftovers.placement_group]
        return []

    def wait_for_release(self, needs: dict[str, float]) -> dict[str, float]:
        """The cluster's free resources once they cover `needs` (or are back to the baseline), or after
        `RELEASE_WAIT_S` if they do not: resources a removed group held show as free with a delay. No
        wait when the cluster does not have `needs` at all (a node is gone: an elastic run tries a
        smaller size after the placement group's wait)."""
        deadline = time.monotonic() + RELEASE_WAIT_S
        while True:
            free = baseline_resources()
            done = covers(free, needs) or covers(free, short(self.baseline)) or time.monotonic() > deadline
            if done or not covers(ray.cluster_resources(), needs):
                return free
            time.sleep(0.05)


def covers(free: dict[str, float], needs: dict[str, float]) -> bool:
    """Whether `free` holds at least `needs` of every resource."""
    return all(free.get(k, 0.0) >= v - 1e-6 for k, v in needs.items())


def start_timeout_s() -> float:
    """Ray Train's placement-group wait per start, seconds (`START_TIMEOUT_ENV`, which the driver sets
    from `failure.group_start_timeout_s`)."""
    return float(os.environ.get(START_TIMEOUT_ENV, 60.0))
