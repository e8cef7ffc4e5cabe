"""`replicas.Replicas` against a real torchft lighthouse and Managers in this process (no Ray): the
step's share comes from the quorum, the gradient reduction, the loss and skip agreement, the
audit's gather, the commit, the final digest record, a replica that joins late healing from its
peer's memory, the replica events, and the guards' checks across the replicas (the fingerprint
proves a healed replica equals its peer and catches a flipped bit on both). The Ray Train run with
its SIGKILLs: tests/test_replicas.py."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchft  # noqa: F401  (the ft extra: a missing torchft fails these guarantees' tests, never skips them)

from raytrain_ft.checkpoint.train_state import (
    KEY_DATA,
    KEY_GUARDS,
    KEY_MODEL,
    KEY_OPTIM,
    KEY_PROGRESS,
    ModelState,
    OptimizerState,
    Pickled,
    Progress,
    TrainState,
)
from raytrain_ft.core.config import FingerprintSection, GuardsSection, RankCheckSection
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.recorder import Gated, NullRecorder, Recorder
from raytrain_ft.core.run_folder import replica_final_file
from raytrain_ft.data.audit import DataAudit
from raytrain_ft.data.position import BatchPlan, DataPosition, Share
from raytrain_ft.model.parallel import Parallel
from raytrain_ft.resilience.guards import (
    RankChecks,
    RankSpreadError,
    ReplicaMismatchError,
    SpikeGuard,
    replica_checksum,
)
from raytrain_ft.resilience.replicas import Replicas, flat_optimizer_state, state_digest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def managers(monkeypatch):
    """Every Manager a test builds is shut down at its end, waiting for its threads (checkpoint
    transport, executor) and closing its process group: Managers left running accumulate threads in
    the one pytest process, and a suite that ran them all crashed natively in this file."""
    built: list[Replicas] = []
    init = Replicas.__init__

    def register(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Replicas, "__init__", register)
    yield
    for r in built:
        r.manager.shutdown(wait=True)  # again after a test's own shutdown(wait=False): it only waits
        r.manager._pg.shutdown()


@pytest.fixture
def lighthouse(monkeypatch):
    """A lighthouse; `replica_store()` points the next Manager at a replica group store of its own
    (the Manager reads the store and lighthouse addresses from the environment when built)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", server.address())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    stores = []

    def replica_store() -> None:
        port = free_port()
        stores.append(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False))
        monkeypatch.setenv("MASTER_PORT", str(port))

    replica_store()
    yield replica_store
    server.shutdown()


def test_one_replica_trains_the_whole_batch_and_commits(lighthouse, tmp_path):
    cfg = load_config(None, ["failure.recovery=replica", "scaling.num_workers=1", "train.global_batch_size=8"])
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainState(0)
    state.add(KEY_MODEL, ModelState(model))
    state.add(KEY_OPTIM, OptimizerState(model, optimizer))
    guard = SpikeGuard(skipped=2)
    state.add(KEY_GUARDS, Pickled(guard))
    replicas = Replicas(cfg, state, replica_index=0, recorder=NullRecorder())
    replicas.start(5, heal_also={})

    share = replicas.begin()
    assert share == Share(BatchPlan(8, cfg.train.micro_batch_size, 1), 0)
    assert replicas.saves and replicas.records
    model(torch.ones(4, 3)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    par = Parallel("ddp", model, model, 1, 1, 0, False)
    replicas.reduce(par)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert replicas.agree(6, 2.5, False, False, False, 2.0) == (2.5, False, False, 0, (0.25,))  # 2 s / 8 sequences
    ids = torch.tensor([4, 9, -1])
    assert torch.equal(replicas.gather(ids), ids[None])
    assert replicas.accepted()
    optimizer.step()
    assert replicas.manager.current_step() == 6  # the Manager counts on from the restored step

    replicas.finish(str(tmp_path))
    record = json.loads(Path(replica_final_file(str(tmp_path), 0)).read_text())
    expected = state_digest({**model.state_dict(), **flat_optimizer_state(state)})
    assert record == {"step": 6, "digest": expected, "skipped": 2}
    assert any(k.startswith("optim.state.weight.") for k in record["digest"])


def test_no_quorum_within_the_bound_is_an_error_not_a_wait(monkeypatch):
    """`waits.quorum_timeout_s`: a replica alone where the lighthouse needs two gets no quorum, and
    `begin()` raises once the bound has passed instead of waiting on (the attempt fails: a restart
    that Ray's FailureConfig counts)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=100, heartbeat_timeout_ms=1000)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    for key, value in {
        "TORCHFT_LIGHTHOUSE": server.address(),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    cfg = load_config(None, ["failure.recovery=replica", "scaling.num_workers=1", "waits.quorum_timeout_s=3"])
    model = torch.nn.Linear(3, 2)
    state = TrainState(0)
    state.add(KEY_MODEL, ModelState(model))
    replicas = Replicas(cfg, state, replica_index=0, recorder=NullRecorder())
    replicas.start(0, heal_also={})
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="Timeout expired"):
            replicas.begin()
        assert 3 <= time.monotonic() - started < 30
    finally:
        server.shutdown()
        del store


STEP_S = 0.2  # a step's other work: a peer started meanwhile joins well before a trains 4 steps alone


class Events(NullRecorder):
    """Keeps the events recorded (kind and fields), records nothing else."""

    def __init__(self):
        self.events: list[dict] = []

    def event(self, kind: str, **fields: object) -> None:
        self.events.append({"kind": kind, **fields})


class Replica:
    """A replica's model, optimizer, progress and spike guard, and the loop's step reduced to its
    replica calls. `skip_at`: steps at which this replica's guard judges the step a skip; `save_at`:
    steps after which the step's saver saves (if `RankChecks.fit_to_save`: the steps in `saved`)."""

    def __init__(
        self,
        cfg,
        index: int,
        data: torch.Tensor,
        replacement: bool = False,
        skip_at: tuple = (),
        save_at: tuple = (),
        fingerprint_every: int = 1000,
        rank_check_every: int = 1000,
        doomed_at: tuple = (),
    ):
        torch.manual_seed(0)  # every replica initialises the same weights
        self.model = torch.nn.Linear(3, 1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.progress, self.position, self.data = Progress(), DataPosition(), data
        self.guard, self.skip_at, self.save_at, self.doomed_at = SpikeGuard(), skip_at, save_at, doomed_at
        self.leaving: list[int] = []  # each step's count of members whose node is drained (`agree`)
        self.saved: list[int] = []
        self.state = TrainState(0)
        self.state.add(KEY_MODEL, ModelState(self.model))
        self.state.add(KEY_OPTIM, OptimizerState(self.model, self.optimizer))
        self.state.add(KEY_PROGRESS, Pickled(self.progress))
        self.state.add(KEY_DATA, Pickled(self.position))
        self.state.add(KEY_GUARDS, Pickled(self.guard))
        self.recorder: Recorder = Events()
        self.replicas = Replicas(cfg, self.state, index, self.recorder, replacement)
        self.audit = DataAudit("unused", self.replicas.gather, enabled=True, width=4)
        self.replicas.start(0, heal_also={"audit": self.audit})
        self.par = Parallel("ddp", self.model, self.model, 1, 1, 0, False)
        self.participants: list[int] = []
        self.skipped: list[int] = []
        # the loop's guards over the replicas, recording as the loop's step recorder does
        guards = GuardsSection(
            rank_check=RankCheckSection(interval_steps=rank_check_every),
            fingerprint=FingerprintSection(interval_steps=fingerprint_every),
            on_alert="restart",
        )
        recorder = Gated(self.recorder, self.replicas)
        self.checks = RankChecks(guards, self.par, self.replicas, recorder, settle=lambda: None)
        self.loss = 1.0  # the loss this replica hands the rank check
        self.fingerprints: list[tuple[int, list]] = []  # (step, the [shard, checksum] rows compared)
        gather = self.replicas.gather

        def spied(row: torch.Tensor) -> torch.Tensor:
            rows = gather(row)
            if row.dtype == torch.int64 and len(row) == 2:  # a fingerprint row (the audit's are 4 wide)
                self.fingerprints.append((self.progress.step, rows.tolist()))
            return rows

        self.replicas.gather = spied  # type: ignore[method-assign]

    def step(self) -> None:
        time.sleep(STEP_S)
        share = self.replicas.begin()
        g = share.plan.global_batch_size
        lo, hi = share.plan.span(share.rank)
        batch = self.data[self.position.consumed : self.position.consumed + g][lo:hi]
        self.audit.record(
            self.progress.step + 1, torch.arange(self.position.consumed, self.position.consumed + g)[lo:hi]
        )
        (self.model(batch).pow(2).sum() / g * share.plan.world_size).backward()  # pass weight n x P / G
        self.replicas.reduce(self.par)
        step = self.progress.step + 1
        may_save = self.replicas.saves and step in self.save_at
        doomed = step in self.doomed_at
        _, skip, before_save, leaving, _ = self.replicas.agree(step, 0.0, step in self.skip_at, may_save, doomed, 0.0)
        self.leaving.append(leaving)
        if self.replicas.accepted():
            self.guard.record(1.0, skip)
            if skip:
                self.skipped.append(step)
            else:
                self.optimizer.step()
            self.progress.step += 1
            self.position.advance(g, steps_per_epoch=100)
            self.participants.append(share.plan.world_size)
            self.checks.monitor(
                step, self.loss, 1.0, before_save
            )  # the rank check and fingerprint, across the replicas
            if may_save and self.checks.fit_to_save(step):
                self.saved.append(step)
        self.optimizer.zero_grad(set_to_none=True)


def test_a_replica_that_joins_late_heals_from_its_peer_and_both_stay_bitwise_equal(lighthouse, process_group):
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=4", "train.micro_batch_size=1"])
    data = torch.randn(40, 3)
    a = Replica(cfg, 0, data)
    for _ in range(3):  # alone: the whole global batch of 4 each step
        a.step()
    lighthouse()
    b = Replica(cfg, 1, data, replacement=True)  # a replacement: fresh state, step 0
    with ThreadPoolExecutor(2) as pool:  # a trains alone on until b's first quorum request arrives
        for f in [
            pool.submit(lambda r=r: [r.step() for _ in iter(lambda: r.progress.step < 7, False)]) for r in (a, b)
        ]:
            f.result()
    joint = len(b.participants)  # b healed at a's step (7 - joint) and trained every step after it with a
    assert joint >= 1 and b.participants == [2] * joint and a.participants == [1] * (7 - joint) + [2] * joint
    assert b.replicas.manager.current_step() == 7
    assert a.position == b.position == DataPosition(0, 28)  # healed, then advanced only by commits
    # b holds the audit of the steps a trained before b joined, so whichever commits next writes them
    assert [s for s, _ in b.audit.rows] == [s for s, _ in a.audit.rows] == list(range(1, 8))
    assert all((x == y).all() for (_, x), (_, y) in zip(a.audit.rows, b.audit.rows, strict=True))
    for key in (KEY_MODEL, KEY_OPTIM):  # bitwise equal weights and AdamW state
        ours, theirs = dict(flat(a.state, key)), dict(flat(b.state, key))
        assert ours and ours.keys() == theirs.keys(), key
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), key
    assert not torch.equal(a.model.weight, Replica(cfg, 2, data).model.weight)  # it trained
    # the replacement's events: restored at step 0, joined at its first committed step with its peer
    first = 7 - joint + 1
    assert b.recorder.events == [
        {"kind": "replica_start", "replica": 1, "resumed_from": 0},
        {"kind": "replica_joined", "replica": 1, "step": first, "participants": 2},
    ]
    assert a.recorder.events == []  # a survivor's steps that commit record no replica event


def flat(state: TrainState, key: str):
    return flat_optimizer_state(state).items() if key == KEY_OPTIM else state.components[key].state_dict().items()


def attempt(r: Replica, step: int) -> bool:
    """Replica `r` trains `step` up to its commit (no audit, no optimizer step); whether it committed."""
    r.replicas.begin()
    g = r.replicas.share.plan.global_batch_size
    (r.model(r.data[r.position.consumed : r.position.consumed + g]).sum()).backward()
    r.replicas.reduce(r.par)
    r.replicas.agree(step, 0.0, False, False, False, 0.0)
    committed = r.replicas.accepted()
    r.optimizer.zero_grad(set_to_none=True)
    return committed


def dies_in_the_quorum(r: Replica) -> None:
    """Replica `r` joins the next quorum, then its process group and Manager go away (a SIGKILL)."""
    r.replicas.begin()
    r.replicas.manager._pg.abort()
    r.replicas.manager.shutdown(wait=False)


def test_a_step_whose_peer_dies_in_the_all_reduce_does_not_commit_and_is_trained_again(lighthouse, process_group):
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=4", "train.micro_batch_size=1"])
    data = torch.randn(40, 3)
    a = Replica(cfg, 0, data)
    lighthouse()
    b = Replica(cfg, 1, data)
    with ThreadPoolExecutor(2) as pool:  # both in the quorum
        for f in [
            pool.submit(lambda r=r: [r.step() for _ in iter(lambda: r.progress.step < 2, False)]) for r in (a, b)
        ]:
            f.result()
    assert b.participants[-1] == 2 and a.participants[-1] == 2

    with ThreadPoolExecutor(2) as pool:
        dying, training = pool.submit(dies_in_the_quorum, b), pool.submit(attempt, a, 3)
        dying.result()
        assert training.result() is False  # the all-reduce failed: the step does not count
    assert a.recorder.events == [{"kind": "step_not_committed", "replica": 0, "step": 3, "participants": 2}]
    before = (a.progress.step, DataPosition(a.position.epoch, a.position.consumed))
    a.step()  # the same step again, alone, from the same data position
    assert a.participants[-1] == 1 and a.progress.step == before[0] + 1
    assert a.position == DataPosition(0, before[1].consumed + 4)


def test_a_skip_judged_by_one_replica_is_every_replicas_skip(lighthouse, process_group):
    """Only b's guard judges step 3 a skip (as a guard would that saw a NaN or a spike the other did
    not): `agree` makes it both replicas' decision, so neither steps its optimizer there and both
    stay bitwise equal."""
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=4", "train.micro_batch_size=1"])
    data = torch.randn(40, 3)
    a = Replica(cfg, 0, data)
    lighthouse()
    b = Replica(cfg, 1, data, skip_at=(3,))
    with ThreadPoolExecutor(2) as pool:
        for f in [
            pool.submit(lambda r=r: [r.step() for _ in iter(lambda: r.progress.step < 5, False)]) for r in (a, b)
        ]:
            f.result()
    assert a.participants[-3:] == b.participants[-3:] == [2, 2, 2]  # both trained steps 3-5 together
    assert a.skipped == b.skipped == [3] and a.guard.skipped == b.guard.skipped == 1
    for key in (KEY_MODEL, KEY_OPTIM):
        ours, theirs = dict(flat(a.state, key)), dict(flat(b.state, key))
        assert ours and all(torch.equal(ours[k], theirs[k]) for k in ours), key


def test_a_replica_whose_node_is_drained_leaves_after_a_committed_step_and_its_peer_loses_no_step(
    lighthouse, process_group
):
    """b's node is drained before step 3 (`doomed`): both replicas agree on it in step 3's
    all-reduce, step 3 commits on both, b leaves the quorum at that boundary without a checkpoint
    (a survives and holds the step), and a trains steps 4-6 alone over the whole global batch: no
    step fails to commit, the data position counts every step once."""
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=4", "train.micro_batch_size=1"])
    data = torch.randn(40, 3)
    a = Replica(cfg, 0, data)
    lighthouse()
    b = Replica(cfg, 1, data, doomed_at=(3,))
    assert train_together((a, b), until=3) == [None, None]
    assert a.leaving == b.leaving == [0, 0, 1] and a.participants == b.participants == [2, 2, 2]
    assert not a.replicas.saves_before_leaving(1)  # a survivor holds the step: no checkpoint needed
    assert b.replicas.leave()
    for _ in range(3):
        a.step()
    assert a.participants == [2, 2, 2, 1, 1, 1] and a.progress.step == 6
    assert a.position == DataPosition(0, 24)
    assert not [e for e in a.recorder.events if e["kind"] == "step_not_committed"]


def test_the_saver_checkpoints_before_leaving_only_when_every_replica_is_drained(lighthouse, process_group):
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=4", "train.micro_batch_size=1"])
    a = Replica(cfg, 0, torch.randn(40, 3))
    lighthouse()
    b = Replica(cfg, 1, a.data)
    assert train_together((a, b), until=1) == [None, None]
    saver, other = (a, b) if a.replicas.saves else (b, a)
    assert saver.replicas.saves_before_leaving(2) and not saver.replicas.saves_before_leaving(1)
    assert not other.replicas.saves_before_leaving(2)


def train_together(replicas: tuple, until: int) -> list:
    """Each replica's steps in its own thread until its step is `until`; each thread's exception or None."""

    def run(r: Replica) -> BaseException | None:
        try:
            while r.progress.step < until:
                r.step()
        except Exception as e:  # noqa: BLE001 - the test asserts what each replica raised
            return e
        return None

    with ThreadPoolExecutor(len(replicas)) as pool:
        return [f.result() for f in [pool.submit(run, r) for r in replicas]]


def test_the_fingerprint_after_a_heal_compares_the_healed_replica_with_its_peer_and_passes(lighthouse, process_group):
    """A late joiner heals from its peer: the fingerprint at every interval after it joined compares
    both replicas' checksums (two rows, equal) and raises nothing, under `on_alert: restart`."""
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=4", "train.micro_batch_size=1"])
    data = torch.randn(40, 3)
    a = Replica(cfg, 0, data, fingerprint_every=2)
    for _ in range(3):
        a.step()
    lighthouse()
    b = Replica(cfg, 1, data, replacement=True, fingerprint_every=2)
    assert train_together((a, b), until=8) == [None, None]
    joint = len(b.participants)
    assert joint >= 2 and a.participants[-joint:] == [2] * joint
    first = 8 - joint + 1  # b's first committed step
    checked = [s for s in range(first, 9) if s % 2 == 0]
    assert checked, "no fingerprint interval after the heal"
    for r in (a, b):  # both replicas compared both rows at every interval after the heal: equal
        together = [(s, rows) for s, rows in r.fingerprints if s >= first]
        assert [s for s, _ in together] == checked
        assert all(len(rows) == 2 and rows[0] == rows[1] for _, rows in together), together
    assert a.fingerprints[-1] == b.fingerprints[-1]
    assert not [e for r in (a, b) for e in r.recorder.events if e["kind"] == "replica_mismatch"]


def test_a_bit_flipped_in_one_replica_is_caught_by_the_fingerprint_on_both_replicas(lighthouse, process_group):
    """Both replicas train steps 1-4 (the fingerprint at 3 passes); one bit of replica b's weights
    flips after step 4; at the next interval, step 6, both replicas raise `ReplicaMismatchError`
    (`on_alert: restart`) with both checksums, and the step's recording replica records one
    `replica_mismatch` event with them."""
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=4", "train.micro_batch_size=1"])
    data = torch.randn(40, 3)
    a = Replica(cfg, 0, data, fingerprint_every=3)
    lighthouse()
    b = Replica(cfg, 1, data, fingerprint_every=3)
    assert train_together((a, b), until=4) == [None, None]
    assert a.participants[-2:] == b.participants[-2:] == [2, 2]
    assert [s for s, _ in a.fingerprints] == [s for s, _ in b.fingerprints] == [3]
    with torch.no_grad():
        b.model.weight.view(torch.int32)[0, 0] ^= 1  # the lowest mantissa bit of one weight
    assert replica_checksum(b.par.local_parameters()) != replica_checksum(a.par.local_parameters())

    raised = train_together((a, b), until=9)
    assert all(isinstance(e, ReplicaMismatchError) for e in raised), raised
    assert all(str(e).startswith("step 6: replica_mismatch") for e in raised), raised
    assert a.progress.step == b.progress.step == 6  # caught at the first interval after the flip
    (_, rows_a), (_, rows_b) = a.fingerprints[-1], b.fingerprints[-1]
    assert rows_a == rows_b and len(rows_a) == 2 and rows_a[0][1] != rows_a[1][1]
    events = [e for r in (a, b) for e in r.recorder.events if e["kind"] == "replica_mismatch"]
    assert events == [{"kind": "replica_mismatch", "step": 6, "shard_checksum_by_rank": rows_a}]


def test_the_saver_saves_only_after_a_fingerprint_across_the_replicas_at_that_step(lighthouse, process_group):
    """The fingerprint's interval never comes (1000); the step's saver saves after steps 3 and 6:
    both replicas compare both checksums at 3 (equal: the saver saves), one bit of b's weights flips
    after step 4, and at 6, before the saver writes the odd weights, both raise `ReplicaMismatchError`
    and nothing is saved."""
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=4", "train.micro_batch_size=1"])
    data = torch.randn(40, 3)
    a = Replica(cfg, 0, data, save_at=(3, 6))
    lighthouse()
    b = Replica(cfg, 1, data, save_at=(3, 6))
    assert train_together((a, b), until=4) == [None, None]
    assert a.participants[-2:] == b.participants[-2:] == [2, 2]
    for r in (a, b):
        assert [s for s, _ in r.fingerprints] == [3]
        assert len(r.fingerprints[0][1]) == 2 and r.fingerprints[0][1][0] == r.fingerprints[0][1][1]
    assert sorted(a.saved + b.saved) == [3]  # one saver, after the check
    assert not a.checks.fit_to_save(4) and not b.checks.fit_to_save(4)  # no fingerprint at step 4: no save
    with torch.no_grad():
        b.model.weight.view(torch.int32)[0, 0] ^= 1

    raised = train_together((a, b), until=9)
    assert all(isinstance(e, ReplicaMismatchError) and str(e).startswith("step 6: replica_mismatch") for e in raised)
    assert [s for s, _ in a.fingerprints] == [s for s, _ in b.fingerprints] == [3, 6]
    assert sorted(a.saved + b.saved) == [3]


def test_a_tenfold_loss_on_one_replica_is_a_rank_spread_alert_on_both(lighthouse, process_group):
    """The rank check compares the participants' [loss, grad norm] rows: replica b's loss is ten
    times a's from step 3 on; at the next interval, step 4, both raise `RankSpreadError`."""
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=4", "train.micro_batch_size=1"])
    data = torch.randn(40, 3)
    a = Replica(cfg, 0, data, rank_check_every=2)
    lighthouse()
    b = Replica(cfg, 1, data, rank_check_every=2)
    assert train_together((a, b), until=2) == [None, None]  # equal losses at step 2: no alert
    b.loss = 10.0
    raised = train_together((a, b), until=9)
    assert all(isinstance(e, RankSpreadError) and str(e).startswith("step 4: rank_spread") for e in raised), raised
    events = [e for r in (a, b) for e in r.recorder.events if e["kind"] == "rank_spread"]
    assert len(events) == 1 and events[0]["step"] == 4
    assert sorted(events[0]["loss_grad_norm_by_rank"]) == [[1.0, 1.0], [10.0, 1.0]]


def test_of_three_replicas_one_dies_in_the_all_reduce_and_the_two_survivors_train_its_step_over_the_whole_batch(
    lighthouse, process_group
):
    """Three replicas train steps 1-3 together (a global batch of 6: 2 sequences each); c dies in
    step 4's all-reduce; a and b do not commit it, train it again as a quorum of two (3 sequences
    each) and step 5 too: every step's sample ids are the global batch's 6, once each, the data
    position counts 5 whole batches, and the survivors stay bitwise equal."""
    cfg = load_config(None, ["failure.recovery=replica", "train.global_batch_size=6", "train.micro_batch_size=1"])
    data = torch.randn(60, 3)
    a = Replica(cfg, 0, data)
    lighthouse()
    b = Replica(cfg, 1, data)
    lighthouse()
    c = Replica(cfg, 2, data)
    assert train_together((a, b, c), until=3) == [None, None, None]
    assert a.participants[-1] == b.participants[-1] == c.participants[-1] == 3

    with ThreadPoolExecutor(3) as pool:
        dying = pool.submit(dies_in_the_quorum, c)
        training = [pool.submit(attempt, r, 4) for r in (a, b)]
        dying.result()
        assert [f.result() for f in training] == [False, False]  # the all-reduce failed: step 4 does not count
    assert train_together((a, b), until=5) == [None, None]
    assert a.participants[-2:] == b.participants[-2:] == [2, 2]
    assert a.position == b.position == DataPosition(0, 30)
    for r in (a, b):
        assert r.recorder.events == [
            {"kind": "step_not_committed", "replica": r.replicas.replica_index, "step": 4, "participants": 3}
        ]
        rows = dict(r.audit.rows)  # step -> (participants, 4) ids, -1 where a share is shorter
        assert sorted(rows) == [1, 2, 3, 4, 5]
        assert [len(rows[s]) for s in (3, 4, 5)] == [3, 2, 2]
        for step, ids in rows.items():
            assert sorted(ids[ids >= 0].tolist()) == list(range(6 * (step - 1), 6 * step)), step
    for key in (KEY_MODEL, KEY_OPTIM):
        ours, theirs = dict(flat(a.state, key)), dict(flat(b.state, key))
        assert ours and all(torch.equal(ours[k], theirs[k]) for k in ours), key
