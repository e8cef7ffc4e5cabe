"""The memory tier's copies on one node, and the choice of the step a restart restores from.

A memory-tier checkpoint (`raytrain_ft.checkpoint.memory_tier`) is one self-contained copy per rank: that
rank's whole train state (every component a durable checkpoint holds, the rank's own shards only),
written by DCP with the same checksums as a durable checkpoint (`raytrain_ft.checkpoint.integrity`). A
node keeps its copies in one folder of its own, `<checkpoint.memory.dir>/<node id>/<run key>/`, on
a RAM-backed file system (`/dev/shm` by default):

    rank-<R>/step-<N>/            the DCP files of rank R's state at step N (`.metadata`, `.checksums`, ...)
    rank-<R>/step-<N>/COMMITTED   JSON {"world_size", "strategy"}: the step counts (written last)

A copy counts only once `COMMITTED` is in it: the ranks write it after they agreed that every
rank's own copy and its peer copies were written and verified (the "never torn" rule of durable
commits). Everything here is plain file work on one node's folder; who calls it decides which node:
a rank on its own node's folder, the node's keeper (`raytrain_ft.launch.memory_keeper`) on its own. No
code reads another node's folder: a node that left the cluster took its copies with it (on one
machine, `ray.cluster_utils.Cluster` nodes share `/dev/shm`: the folder per node id keeps them apart).

`plan_restore` is the restore's decision, a pure function of what every live node holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from raytrain_ft.checkpoint.integrity import verify_checkpoint

COMMITTED = "COMMITTED"
KEEP = 2  # committed copies each node keeps per (run, rank): the newest and the one before it


def run_key(run_id: str) -> str:
    """The run's name among a node's copies, from its MLflow run id: the same run across restarts and
    resubmissions; another run, or a run folder deleted to start over (a new MLflow run), another key."""
    return hashlib.sha256(run_id.encode()).hexdigest()[:16]


def copy_path(node_dir: str, rank: int, step: int) -> str:
    """Rank `rank`'s copy of step `step` in the run's folder `node_dir` of one node."""
    return os.path.join(node_dir, f"rank-{rank}", f"step-{step}")


def read_files(folder: str) -> dict[str, bytes]:
    """Every file of a copy (name -> bytes), `COMMITTED` left out: what a peer copy sends."""
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.name != COMMITTED}


def write_files(folder: str, files: dict[str, bytes]) -> None:
    """Write a copy's `files` into `folder`, replacing what was there."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    for name, data in files.items():
        Path(folder, name).write_bytes(data)


def verify(folder: str) -> list[str]:
    """Every byte of the copy in `folder` against its checksums (`integrity.verify_checkpoint`; components
    not checked: a rank holds only its own); the problems, [] when intact."""
    return verify_checkpoint(folder, components=False)


def commit(node_dir: str, rank: int, step: int, topology: dict) -> bool:
    """Mark rank `rank`'s copy of `step` in `node_dir` as counting, with the run's `topology`
    ({"world_size", "strategy"}), then keep the newest `KEEP` committed copies of the rank (and no
    uncommitted one older than the newest committed). False when the copy is not there."""
    folder = copy_path(node_dir, rank, step)
    if not os.path.isdir(folder):
        return False
    tmp = os.path.join(folder, COMMITTED + ".tmp")
    with open(tmp, "w") as f:
        json.dump(topology, f)
    os.replace(tmp, os.path.join(folder, COMMITTED))
    prune(node_dir, rank)
    return True


def _steps(node_dir: str, rank: int) -> dict[int, bool]:
    """Step -> committed, of every copy of `rank` in `node_dir`."""
    base = os.path.join(node_dir, f"rank-{rank}")
    if not os.path.isdir(base):
        return {}
    return {
        int(name.removeprefix("step-")): os.path.exists(os.path.join(base, name, COMMITTED))
        for name in os.listdir(base)
        if name.startswith("step-") and name.removeprefix("step-").isdigit()
    }


def prune(node_dir: str, rank: int) -> None:
    """Delete the rank's copies but the newest `KEEP` committed ones and any uncommitted one newer than
    them (a save in flight)."""
    steps = _steps(node_dir, rank)
    kept = sorted((s for s, done in steps.items() if done), reverse=True)[:KEEP]
    newest = kept[0] if kept else -1
    for s, done in steps.items():
        if s not in kept and (done or s < newest):
            shutil.rmtree(copy_path(node_dir, rank, s), ignore_errors=True)


def _ranks(node_dir: str) -> list[int]:
    if not os.path.isdir(node_dir):
        return []
    return [int(n.removeprefix("rank-")) for n in os.listdir(node_dir) if n.startswith("rank-")]


def inventory(node_dir: str) -> dict[int, dict[int, dict]]:
    """rank -> step -> topology of every committed copy in the run's folder `node_dir` of one node."""
    found: dict[int, dict[int, dict]] = {}
    for rank in _ranks(node_dir):
        for step, done in _steps(node_dir, rank).items():
            if done:
                with open(os.path.join(copy_path(node_dir, rank, step), COMMITTED)) as f:
                    found.setdefault(rank, {})[step] = json.load(f)
    return found


def discard_after(node_dir: str, step: int) -> list[tuple[int, int]]:
    """Delete every copy newer than `step` (a restore or a rollback to `step` abandons them: they are a
    trajectory the run no longer follows); returns the (rank, step) pairs deleted."""
    removed = []
    for rank in _ranks(node_dir):
        for s in _steps(node_dir, rank):
            if s > step:
                shutil.rmtree(copy_path(node_dir, rank, s), ignore_errors=True)
                removed.append((rank, s))
    return sorted(removed)


def bytes_per_node(rank_bytes: int, ranks_per_node: int, peer_copies: int) -> int:
    """The most bytes the tier holds on one node: its ranks' own copies and the copies it keeps for its
    peers' ranks (as many again per peer copy), each `KEEP` committed steps plus one being written."""
    return rank_bytes * ranks_per_node * (1 + peer_copies) * (KEEP + 1)


def free_bytes(folder: str) -> int:
    """Free bytes of the file system that holds `folder` (or would: its nearest existing parent)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


class Keepers(Protocol):
    """The memory tier's reach beyond this rank's own node (`raytrain_ft.launch.memory_keeper` on Ray):
    the keepers of the nodes, one per node, each the only reader and writer of its node's folder for
    other nodes. Every call is bounded (`waits.commit_timeout_s`); a keeper that does not answer in
    time (its node is gone) counts as holding nothing."""

    node: str  # this rank's node id
    node_dir: str  # the run's folder on this rank's node: the rank writes and reads its own copies here

    def replicate(self, rank: int, step: int, nodes: list[str]) -> int:
        """Send the rank's copy of `step` (in `node_dir`) to the keepers of `nodes`; each writes and
        verifies it. Returns how many hold a verified copy."""

    def commit(self, rank: int, step: int, nodes: list[str], topology: dict) -> int:
        """`commit` the rank's copy of `step` on its own node and at the keepers of `nodes`; returns how many did."""

    def inventory(self) -> dict[str, dict[int, dict[int, dict]]]:
        """node -> `inventory` of the run's folder of every live node's keeper."""

    def nodes(self) -> list[str]:
        """Every live node that has a keeper (a rank of a memory-tier run ran there), this one included."""

    def fetch(self, node: str, rank: int, step: int) -> str:
        """Bring the copy of (`rank`, `step`) that `node`'s keeper holds into a local folder and return
        its path (under `node_dir`).

        Raises:
            TimeoutError: the keeper did not answer in time (its node is gone).
        """

    def discard_after(self, step: int) -> None:
        """`discard_after(step)` on every live node's keeper."""


@dataclass(frozen=True)
class RestorePlan:
    """The newest step every rank can be served from: `sources[r]` lists the nodes holding rank r's
    copy, its own node first; `skipped`: one line per copy passed over (another topology)."""

    step: int | None
    sources: list[list[str]]
    skipped: list[str]


def plan_restore(
    held: dict[str, dict[int, dict[int, dict]]], nodes: list[str], durable_step: int, topology: dict
) -> RestorePlan:
    """Where each rank restores from (NVIDIA's local checkpointing `find_latest`: the newest iteration
    every rank holds).

    Args:
        held: node -> rank -> step -> topology of the committed copies of every live node (`Keepers.inventory`).
        nodes: the node of each rank now (index: rank).
        durable_step: the step of the durable checkpoint Ray committed (0: none); a memory step older
            than it is never used, an equal one is (the same state, read from memory).
        topology: this attempt's {"world_size", "strategy"}: a copy of another is skipped (an elastic
            resize falls back to durable storage).

    Returns: the plan; `step` None when no step newer than or equal to `durable_step` is held for every rank.
    """
    skipped = sorted(
        f"rank {r} step {s} on node {node}: saved at {t}, now {topology}"
        for node, ranks in held.items()
        for r, steps in ranks.items()
        for s, t in steps.items()
        if t != topology and s >= durable_step
    )
    steps = sorted({s for ranks in held.values() for st in ranks.values() for s in st}, reverse=True)
    for step in (s for s in steps if s >= durable_step and s > 0):
        sources = []
        for r, own in enumerate(nodes):
            holders = [n for n, ranks in held.items() if ranks.get(r, {}).get(step) == topology]
            sources.append(sorted(holders, key=lambda n: n != own))
        if all(sources):
            return RestorePlan(step, sources, skipped)
    return RestorePlan(None, [[] for _ in nodes], skipped)


def peers(nodes: list[str], node: str, copies: int, others: list[str]) -> list[str]:
    """The nodes that keep `node`'s peer copies: the next `copies` distinct nodes after it in the ring of
    `nodes` (each rank's node, by rank); when the group spans fewer other nodes than `copies`, then the
    first of `others` (nodes with a live keeper, sorted) outside the group, fewer when there are none.
    Under replica recovery every replica is a group of one: its peers are other replicas' nodes."""
    ring = list(dict.fromkeys(nodes))
    i = ring.index(node)
    in_group = [ring[(i + k) % len(ring)] for k in range(1, min(copies, len(ring) - 1) + 1)]
    return in_group + [n for n in sorted(others) if n not in ring][: copies - len(in_group)]
