"""The memory tier's pure parts, without Ray: a node's folder of copies and the restore decision."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import REPO
from raytrain_ft.checkpoint import memory_copies as copies
from raytrain_ft.checkpoint.integrity import ChecksummedWriter
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.data.manifest import Manifest
from raytrain_ft.training.preflight import check_memory_tier

TOPOLOGY = {"world_size": 2, "parallel.strategy": "ddp"}


def held(*entries: tuple[str, int, int], topology: dict = TOPOLOGY) -> dict:
    """node -> rank -> step -> topology, from (node, rank, step) triples."""
    out: dict = {}
    for node, rank, step in entries:
        out.setdefault(node, {}).setdefault(rank, {})[step] = topology
    return out


def test_the_newest_step_every_rank_holds_wins_own_node_first():
    # rank 0 on a, rank 1 on b; step 9 lacks rank 1's copy anywhere: step 6 is the newest for both
    plan = copies.plan_restore(
        held(("a", 0, 9), ("a", 0, 6), ("b", 0, 6), ("b", 1, 6), ("a", 1, 6)), ["a", "b"], 5, TOPOLOGY
    )
    assert plan.step == 6 and plan.sources == [["a", "b"], ["b", "a"]] and plan.skipped == []


def test_a_lost_nodes_ranks_are_served_by_their_peers_copies():
    # node b is gone; rank 1 now runs on c and its copy lives only on a (its peer)
    plan = copies.plan_restore(held(("a", 0, 6), ("a", 1, 6), ("c", 0, 3)), ["a", "c"], 5, TOPOLOGY)
    assert plan.step == 6 and plan.sources == [["a"], ["a"]]


def test_never_older_than_the_durable_checkpoint_and_another_topology_is_skipped():
    older = copies.plan_restore(held(("a", 0, 6), ("a", 1, 6)), ["a", "a"], 10, TOPOLOGY)
    assert older.step is None
    equal = copies.plan_restore(held(("a", 0, 10), ("a", 1, 10)), ["a", "a"], 10, TOPOLOGY)
    assert equal.step == 10  # the same state as the durable one, read from memory
    resized = copies.plan_restore(
        held(("a", 0, 12), ("a", 1, 12), topology={"world_size": 3}), ["a", "a"], 10, TOPOLOGY
    )
    assert resized.step is None and len(resized.skipped) == 2 and "world_size" in resized.skipped[0]


def test_peers_are_the_next_distinct_nodes_of_the_ring_then_other_keepers_nodes():
    nodes = ["a", "a", "b", "c"]
    others = ["a", "b", "c", "d", "e"]  # nodes with a live keeper
    assert copies.peers(nodes, "a", 1, others) == ["b"] and copies.peers(nodes, "c", 2, others) == ["a", "b"]
    assert copies.peers(nodes, "b", 3, others) == ["c", "a", "d"]  # the group spans two other nodes
    assert copies.peers(["a", "a"], "a", 1, ["a"]) == []  # one node in the cluster: no peer to copy to
    # replica recovery: each replica a group of one; its peer is another replica's node
    assert copies.peers(["c"], "c", 1, ["e", "c", "a"]) == ["a"]


def test_a_copy_counts_once_committed_and_a_node_keeps_two(tmp_path):
    node = str(tmp_path)
    for step in (3, 6, 9, 12):
        copies.write_files(copies.copy_path(node, 0, step), {"x": b"1"})
    assert copies.inventory(node) == {}  # written, not committed: nothing to restore from
    for step in (3, 6, 9):
        assert copies.commit(node, 0, step, TOPOLOGY)
    assert copies.inventory(node) == {0: {6: TOPOLOGY, 9: TOPOLOGY}}
    assert os.path.isdir(copies.copy_path(node, 0, 12))  # a newer save in flight is kept
    assert copies.discard_after(node, 6) == [(0, 9), (0, 12)]
    assert copies.inventory(node) == {0: {6: TOPOLOGY}}
    assert not copies.commit(node, 1, 6, TOPOLOGY)  # no such copy


def test_a_peer_copy_is_verified_byte_by_byte(tmp_path):
    """What a keeper checks of a copy it received (`Keeper.put`): the checksums written with it."""
    source, received = str(tmp_path / "source"), str(tmp_path / "received")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": the intent here
        dcp.save({"w": torch.arange(1000.0)}, storage_writer=ChecksummedWriter(source), no_dist=True)
    files = copies.read_files(source)
    copies.write_files(received, files)
    assert copies.verify(received) == []
    [data] = [name for name in files if name.endswith(".distcp")]
    damaged = bytearray(files[data])
    damaged[len(damaged) // 2] ^= 0x10
    copies.write_files(received, {**files, data: bytes(damaged)})
    assert "fails its checksum" in " ".join(copies.verify(received))


def test_check_refuses_a_memory_tier_that_does_not_fit_a_node_in_one_line():
    """configs/gpu-70b.yaml with the tier on: 8 ranks x (parameters + AdamW) x 2 copies x 3 steps:
    578 GiB per node, above a 512 GiB bound."""
    cfg = load_config(
        os.path.join(REPO, "configs", "gpu-70b.yaml"),
        ["checkpoint.memory.interval_steps=10", f"checkpoint.memory.max_bytes_per_node={512 * 2**30}"],
    )
    manifest = Manifest(1000, 2048, 32000, 2, "tokenizer.json", "x", [])
    with pytest.raises(ConfigError) as e:
        check_memory_tier(cfg, manifest)
    assert (
        "\n" not in str(e.value)
        and "the memory tier needs about" in str(e.value)
        and "578.2 GiB per node" in str(e.value)
    )
    cfg.checkpoint.memory.max_bytes_per_node = 2**50
    check_memory_tier(cfg, manifest)  # fits: no error
