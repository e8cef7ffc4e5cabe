"""The guards' decisions as pure functions: spike skips, the cross-rank spread, replica fingerprints (no Ray)."""

from __future__ import annotations

import math

import pytest
import torch

from raytrain_ft.core.config import GuardsSection
from raytrain_ft.core.recorder import NullRecorder
from raytrain_ft.resilience.faults import flip_bit
from raytrain_ft.resilience.guards import (
    GuardError,
    NoRollbackTargetError,
    RankChecks,
    RankSpreadError,
    ReplicaMismatchError,
    SkipDisagreementError,
    SpikeGuard,
    mismatch_alert,
    rank_spread,
    replica_checksum,
    replica_mismatch,
    spread_alert,
)


def test_a_spike_is_judged_only_after_warmup_and_against_the_median_of_the_window():
    guard = SpikeGuard(factor=10.0, window=4, warmup=3)
    # before warmup (fewer than 3 accepted norms) nothing finite is a spike, however large
    assert guard.decide(1.0) == (False, None)
    assert guard.decide(1000.0) == (False, 1.0)
    assert guard.decide(2.0) == (False, 500.5)
    # warm: history [1, 1000, 2], median 2 -> the threshold is 20
    assert guard.decide(20.0) == (False, 2.0)  # at the threshold: accepted (strictly above skips)
    assert list(guard.history) == [1.0, 1000.0, 2.0, 20.0]
    assert guard.decide(20.5) == (False, 11.0)  # median of [1, 1000, 2, 20] is 11 -> threshold 110
    assert list(guard.history) == [1000.0, 2.0, 20.0, 20.5]  # the window keeps the newest 4
    assert guard.decide(205.0) == (True, 20.25)  # 205 > 10 x 20.25: skipped, history unchanged
    assert list(guard.history) == [1000.0, 2.0, 20.0, 20.5]
    assert (guard.consecutive, guard.skipped) == (1, 1)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_norm_is_skipped_even_before_warmup(bad):
    guard = SpikeGuard(factor=10.0, window=4, warmup=3)
    assert guard.decide(bad) == (True, None)
    assert list(guard.history) == [] and (guard.consecutive, guard.skipped) == (1, 1)


def test_consecutive_skips_reset_on_an_accepted_step_and_the_total_does_not():
    guard = SpikeGuard(factor=10.0, window=10, warmup=2)
    for n in (1.0, 1.0):
        guard.decide(n)
    assert [guard.decide(n)[0] for n in (50.0, math.nan, 11.0)] == [True, True, True]
    assert (guard.consecutive, guard.skipped) == (3, 3)
    assert guard.decide(9.0) == (False, 1.0)
    assert (guard.consecutive, guard.skipped) == (0, 3)


def test_the_guard_state_round_trips_and_the_restored_guard_decides_the_same():
    guard = SpikeGuard(factor=10.0, window=3, warmup=3)
    for n in (1.0, 2.0, 3.0, math.nan):
        guard.decide(n)
    restored = SpikeGuard(factor=10.0, window=3, warmup=3)
    restored.load_state_dict(guard.state_dict())
    assert guard.state_dict() == {"history": [1.0, 2.0, 3.0], "consecutive": 1, "skipped": 1}
    assert restored.state_dict() == guard.state_dict()
    assert restored.decide(19.9) == guard.decide(19.9) == (False, 2.0)
    assert restored.decide(31.0) == guard.decide(31.0) == (True, 3.0)


def test_rank_spread_is_max_minus_min_over_the_absolute_mean_per_column():
    rows = torch.tensor([[2.0, 1.0], [4.0, 1.0], [6.0, -3.0]], dtype=torch.float64)
    spread = rank_spread(rows)
    assert spread.shape == (2,)
    assert spread[0].item() == pytest.approx((6 - 2) / 4)
    assert spread[1].item() == pytest.approx((1 - -3) / (1 / 3), rel=1e-6)  # |mean| 1/3


def test_a_spread_alert_fires_strictly_above_max_spread_and_carries_the_rows():
    rows = torch.tensor([[1.0, 2.0], [1.5, 2.0]], dtype=torch.float64)  # loss spread 0.5 / 1.25 = 0.4
    assert spread_alert(rows, max_spread=0.4) is None
    detail = spread_alert(rows, max_spread=0.39)
    assert detail == {"loss_grad_norm_by_rank": [[1.0, 2.0], [1.5, 2.0]], "spread": [pytest.approx(0.4), 0.0]}


def test_a_tenfold_loss_on_one_rank_alerts_and_identical_ranks_do_not():
    assert spread_alert(torch.tensor([[3.0, 5.0]] * 4, dtype=torch.float64), max_spread=0.0) is None
    detail = spread_alert(torch.tensor([[3.0, 5.0], [30.0, 5.0]], dtype=torch.float64), max_spread=0.5)
    assert detail is not None and detail["spread"][0] == pytest.approx(27 / 16.5)


def test_a_nan_loss_is_left_to_the_spike_guard():
    rows = torch.tensor([[math.nan, 1.0], [1.0, 1.0]], dtype=torch.float64)
    assert spread_alert(rows, max_spread=0.1) is None


def test_replicas_of_the_same_shard_must_agree_and_different_shards_may_differ():
    # DDP: one shard (0) held by every rank
    assert mismatch_alert(torch.tensor([[0, 7], [0, 7], [0, 7]])) is None
    assert mismatch_alert(torch.tensor([[0, 7], [0, 8]])) == {"shard_checksum_by_rank": [[0, 7], [0, 8]]}
    # HSDP, 2 shards x 2 replica groups: ranks 0, 2 hold shard 0; ranks 1, 3 hold shard 1
    hsdp = torch.tensor([[0, 11], [1, 22], [0, 11], [1, 22]])
    assert not replica_mismatch(hsdp) and mismatch_alert(hsdp) is None
    flipped = hsdp.clone()
    flipped[3, 1] = 23
    assert replica_mismatch(flipped)
    assert mismatch_alert(flipped) == {"shard_checksum_by_rank": [[0, 11], [1, 22], [0, 11], [1, 23]]}


def test_one_flipped_bit_changes_the_checksum_and_equal_tensors_give_equal_ones():
    params = [torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.ones(4, dtype=torch.bfloat16)]
    copy = [p.clone() for p in params]
    assert replica_checksum(params) == replica_checksum(copy)
    expected = sum(int(p.contiguous().view(torch.int32).to(torch.int64).sum()) for p in params[:1])
    expected += int(params[1].view(torch.int16).to(torch.int64).sum())
    assert replica_checksum(params) == expected
    flip_bit(copy[0])
    assert replica_checksum(copy) - replica_checksum(params) in (1 << 20, -(1 << 20))


@pytest.mark.parametrize(
    ("kind", "error"), [("rank_spread", RankSpreadError), ("replica_mismatch", ReplicaMismatchError)]
)
def test_an_alert_under_restart_raises_its_own_guard_error_after_settling(kind, error):
    settled = []
    checks = RankChecks(GuardsSection(on_alert="restart"), None, None, NullRecorder(), lambda: settled.append(1))  # type: ignore[arg-type]
    with pytest.raises(GuardError) as raised:
        checks.alert(7, kind, {"detail": 1})
    assert type(raised.value) is error and str(raised.value) == f"step 7: {kind} {{'detail': 1}}"
    assert settled == [1]  # the in-flight checkpoint commits first
    RankChecks(GuardsSection(on_alert="warn"), None, None, NullRecorder(), settled.clear).alert(7, kind, {})  # type: ignore[arg-type]
    assert settled == [1]  # warn: logged, no settle, no raise


def test_every_guard_stop_has_its_own_type_under_one_base():
    causes = (ReplicaMismatchError, RankSpreadError, SkipDisagreementError, NoRollbackTargetError)
    assert len(set(causes)) == 4 and all(issubclass(c, GuardError) and c is not GuardError for c in causes)
    assert not any(issubclass(a, b) for a in causes for b in causes if a is not b)
