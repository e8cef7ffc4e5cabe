"""The memory tier's commit rule on one rank (a gloo group of one, real DCP files): a step counts only when
its peer copies are verified, and a restore reads the newest committed copy."""

from __future__ import annotations

import torch
import torch.distributed as dist

from raytrain_ft.checkpoint import memory_copies as copies
from raytrain_ft.checkpoint.memory_tier import MEMORY, MemoryTier
from raytrain_ft.checkpoint.train_state import KEY_META, ModelState, RunMeta, TrainState

TOPOLOGY = {"world_size": 1}


class OneNode:
    """`memory_copies.Keepers` of a node whose peers (`peer_ok`) verify a copy or lose it: the folder work
    is the real one (`memory_copies`); only the other node is left out (`replicate` answers for it)."""

    node = "a"

    def __init__(self, node_dir: str, peer_ok: bool):
        self.node_dir, self.peer_ok = node_dir, peer_ok

    def replicate(self, rank: int, step: int, nodes: list[str]) -> int:
        return len(nodes) if self.peer_ok else 0  # a peer lost while the copy was on its way

    def commit(self, rank: int, step: int, nodes: list[str], topology: dict) -> int:
        return int(copies.commit(self.node_dir, rank, step, topology))

    def inventory(self) -> dict:
        return {self.node: copies.inventory(self.node_dir)}

    def nodes(self) -> list[str]:
        return [self.node, "b"]  # one other node: the peer of this rank's copies

    def fetch(self, node: str, rank: int, step: int) -> str:
        raise TimeoutError(f"node {node} is gone")

    def discard_after(self, step: int) -> None:
        copies.discard_after(self.node_dir, step)


def state_of(model: torch.nn.Module) -> TrainState:
    state = TrainState(rank=0)
    state.add("model", ModelState(model))
    state.add(KEY_META, RunMeta({"model": "linear"}))
    return state


def test_a_step_whose_peer_copy_was_lost_never_counts_and_the_restore_takes_the_newest_that_did(
    tmp_path, process_group
):
    keepers = OneNode(str(tmp_path), peer_ok=True)
    model = torch.nn.Linear(4, 4)
    tier = MemoryTier(keepers, 1, dist.new_group(backend="gloo"), 60.0, TOPOLOGY)
    state = state_of(model)
    tier.save(2, state)
    assert tier.wait() == (2, True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    keepers.peer_ok = False
    tier.save(4, state)
    assert tier.wait() == (4, False)  # written here, its peer copy lost: never counts
    assert copies.inventory(str(tmp_path)) == {0: {2: TOPOLOGY}}

    restored = torch.nn.Linear(4, 4)
    loaded = tier.restore(state_of(restored), 0, lambda path, why: None, lambda line: None)
    assert loaded is not None and loaded[0] == 2 and loaded[2] == MEMORY
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in saved.items())
