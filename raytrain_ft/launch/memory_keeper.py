"""The memory tier on Ray: one keeper actor per node, outside the worker processes Ray Train replaces.

Ray Train 2.60 starts every worker process anew on a restart, and an object in Ray's store dies with
the process that put it; so a node's copies live in files of its own folder on a RAM-backed file
system (`checkpoint.memory.dir`, `/dev/shm/raytrain-ft` by default: `<dir>/<node id>/<run key>/`,
`raytrain_ft.checkpoint.memory_copies`), and a `Keeper` actor on that node is the only way another
node reaches them. A keeper is a named, detached actor (`raytrain-ft-keeper-<node id>`, namespace
`raytrain-ft`), `num_cpus=0`, pinned to its node (`NodeAffinitySchedulingStrategy(soft=False)`); the
first rank on a node creates it (`get_if_exists`), and it lives until its node goes (taking the
node's copies with it) or the cluster stops. The driver drops a finished run's copies
(`drop_run`).

`RayKeepers` is the `memory_copies.Keepers` of a Ray Train worker: its own node's folder directly,
every other node through that node's live keeper, each call bounded by `timeout_s`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ft.checkpoint import memory_copies as copies

NAMESPACE = "raytrain-ft"
log = logging.getLogger(__name__)


def keeper_name(node: str) -> str:
    return f"raytrain-ft-keeper-{node}"


@ray.remote(num_cpus=0)
class Keeper:
    """The copies of one node, for callers on other nodes. Each call names the run's folder on this node
    (`<checkpoint.memory.dir>/<node id>/<run key>`): one keeper serves every run and every `dir`."""

    def put(self, node_dir: str, rank: int, step: int, files: dict[str, bytes]) -> bool:
        """Write a peer's copy and verify every byte; True when intact."""
        folder = copies.copy_path(node_dir, rank, step)
        copies.write_files(folder, files)
        problems = copies.verify(folder)
        if problems:
            log.warning("peer copy of rank %d step-%d is damaged: %s", rank, step, "; ".join(problems))
        return not problems

    def commit(self, node_dir: str, rank: int, step: int, topology: dict) -> bool:
        return copies.commit(node_dir, rank, step, topology)

    def inventory(self, node_dir: str) -> dict[int, dict[int, dict]]:
        return copies.inventory(node_dir)

    def get(self, node_dir: str, rank: int, step: int) -> dict[str, bytes]:
        return copies.read_files(copies.copy_path(node_dir, rank, step))

    def discard_after(self, node_dir: str, step: int) -> list[tuple[int, int]]:
        return copies.discard_after(node_dir, step)

    def drop(self, node_dir: str) -> None:
        shutil.rmtree(node_dir, ignore_errors=True)


def _live_keepers() -> dict[str, ray.actor.ActorHandle]:
    """node id -> keeper of every alive node that has one."""
    found = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        with contextlib.suppress(ValueError):  # no keeper there (no rank of a memory-tier run ran on it)
            found[node["NodeID"]] = ray.get_actor(keeper_name(node["NodeID"]), namespace=NAMESPACE)
    return found


def _gather(calls: dict[str, ray.ObjectRef], timeout_s: float) -> dict[str, object]:
    """The answers of `calls` (node -> call) that came within `timeout_s` and did not fail."""
    ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s)
    answers = {}
    for node, ref in calls.items():
        if ref in ready:
            try:
                answers[node] = ray.get(ref, timeout=0)
            except ray.exceptions.RayError as e:  # its node is gone (the keeper died with it)
                log.warning("keeper of node %s: %s", node, e)
    return answers


class RayKeepers:
    """`memory_copies.Keepers` of a Ray Train worker (module doc).

    Args:
        memory_dir: `checkpoint.memory.dir`.
        run_id: the run's MLflow run id (its copies' key: `memory_copies.run_key`).
        timeout_s: the bound of every call to a keeper (`waits.commit_timeout_s`).
    """

    def __init__(self, memory_dir: str, run_id: str, timeout_s: float):
        self.node = ray.get_runtime_context().get_node_id()
        self.memory_dir, self.key, self.timeout_s = memory_dir, copies.run_key(run_id), timeout_s
        self.node_dir = self.dir_on(self.node)
        Keeper.options(  # type: ignore[attr-defined]
            name=keeper_name(self.node),
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(self.node, soft=False),
        ).remote()

    def dir_on(self, node: str) -> str:
        """The run's folder on `node` (read or written there only, by that node's keeper or its ranks)."""
        return run_dir(self.memory_dir, node, self.key)

    def replicate(self, rank: int, step: int, nodes: list[str]) -> int:
        if not nodes:
            return 0
        files = ray.put(copies.read_files(copies.copy_path(self.node_dir, rank, step)))
        keepers = _live_keepers()
        calls = {n: keepers[n].put.remote(self.dir_on(n), rank, step, files) for n in nodes if n in keepers}
        return sum(1 for ok in _gather(calls, self.timeout_s).values() if ok) if calls else 0

    def commit(self, rank: int, step: int, nodes: list[str], topology: dict) -> int:
        keepers = _live_keepers()
        calls = {n: keepers[n].commit.remote(self.dir_on(n), rank, step, topology) for n in nodes if n in keepers}
        own = int(copies.commit(self.node_dir, rank, step, topology))
        return own + sum(1 for ok in (_gather(calls, self.timeout_s) if calls else {}).values() if ok)

    def inventory(self) -> dict[str, dict[int, dict[int, dict]]]:
        calls = {n: k.inventory.remote(self.dir_on(n)) for n, k in _live_keepers().items()}
        return _gather(calls, self.timeout_s) if calls else {}  # type: ignore[return-value]

    def nodes(self) -> list[str]:
        return sorted(_live_keepers())

    def fetch(self, node: str, rank: int, step: int) -> str:
        keeper = _live_keepers().get(node)
        if keeper is None:
            raise TimeoutError(f"node {node} has no live keeper")
        answer = _gather({node: keeper.get.remote(self.dir_on(node), rank, step)}, self.timeout_s)
        if node not in answer:
            raise TimeoutError(f"the keeper of node {node} did not answer within {self.timeout_s:g} s")
        folder = os.path.join(self.node_dir, "fetched", f"rank-{rank}", f"step-{step}")
        copies.write_files(folder, answer[node])  # type: ignore[arg-type]  # verified as it loads
        return folder

    def discard_after(self, step: int) -> None:
        calls = {n: k.discard_after.remote(self.dir_on(n), step) for n, k in _live_keepers().items()}
        if calls:
            _gather(calls, self.timeout_s)


def run_dir(memory_dir: str, node: str, key: str) -> str:
    """`<checkpoint.memory.dir>/<node id>/<run key>`: a run's copies on one node."""
    return os.path.join(memory_dir, node, key)


def drop_run(memory_dir: str, run_id: str) -> None:
    """Delete the copies of the finished run `run_id` (its MLflow run id) under `memory_dir` on every
    live node (the driver, after the run succeeded: a finished run is not restored from memory)."""
    key = copies.run_key(run_id)
    calls = {n: k.drop.remote(run_dir(memory_dir, n, key)) for n, k in _live_keepers().items()}
    if calls:
        _gather(calls, 30.0)
