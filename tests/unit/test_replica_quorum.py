"""`replicas.Replicas` against a real torchft lighthouse and Manager, one replica in this process
(no Ray): the step's share comes from the quorum, the gradient and loss reductions, the audit's
gather, the commit, and the final digest record. Two replicas, a kill and a heal: tests/test_replicas.py."""

import json
import socket

import pytest
import torch
import torch.distributed as dist

from raytrain_ft.config import load_config
from raytrain_ft.data.position import BatchPlan
from raytrain_ft.parallel import Parallel
from raytrain_ft.replicas import Replicas, Share, flat_optimizer_state, state_digest
from raytrain_ft.train_state import KEY_MODEL, KEY_OPTIM, ModelState, OptimizerState, TrainState

torchft = pytest.importorskip("torchft")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lighthouse(monkeypatch):
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", server.address())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    yield
    del store
    server.shutdown()


def test_one_replica_trains_the_whole_batch_and_commits(lighthouse, tmp_path):
    cfg = load_config(None, ["failure.recovery=replica", "scaling.num_workers=1", "train.global_batch_size=8"])
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainState(0)
    state.add(KEY_MODEL, ModelState(model))
    state.add(KEY_OPTIM, OptimizerState(model, optimizer))
    replicas = Replicas(cfg, state, replica_index=0, step=5)

    share = replicas.begin()
    assert share == Share(BatchPlan(8, cfg.train.micro_batch_size, 1), 0)
    assert replicas.saves
    model(torch.ones(4, 3)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    par = Parallel("ddp", model, model, 1, 1, 0, False)
    assert replicas.reduce(par, 2.5) == 2.5  # the sum over one participant
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    ids = torch.tensor([4, 9, -1])
    assert torch.equal(replicas.gather(ids), ids[None])
    assert replicas.commit()
    optimizer.step()
    assert replicas.manager.current_step() == 6  # the Manager counts on from the restored step

    replicas.finish(str(tmp_path))
    record = json.loads((tmp_path / "workers" / "replica0.final.json").read_text())
    expected = state_digest({**model.state_dict(), **flat_optimizer_state(state)})
    assert record == {"step": 6, "digest": expected}
    assert any(k.startswith("optim.state.weight.") for k in record["digest"])
