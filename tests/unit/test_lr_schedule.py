"""The LR schedules alone (no Ray, no process group): wsd's LR at every step, cosine as it was, and
when a run may be extended."""

from __future__ import annotations

import pickle

import pytest
import torch

from raytrain_ft.core.config import TrainSection
from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.core.schedule import extension_refusal, lr_schedule

LR = 1.0e-3


def logged_lrs(t: TrainSection, steps: int | None = None, scheduler=None, optimizer=None) -> list[float]:
    """The LR logged after each step (the loop's order: optimizer step, then scheduler step)."""
    if optimizer is None:
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
        scheduler = lr_schedule(optimizer, t)
    out = []
    for _ in range(t.max_steps if steps is None else steps):
        optimizer.step()
        scheduler.step()
        out.append(scheduler.get_last_lr()[0])
    return out


def wsd(max_steps: int, decay_steps: int = 4) -> TrainSection:
    return TrainSection(
        max_steps=max_steps, warmup_steps=5, lr=LR, min_lr_ratio=0.1, lr_schedule="wsd", decay_steps=decay_steps
    )


def test_wsd_warms_up_holds_lr_then_decays_linearly_to_the_floor():
    # factor(k) = min(1, (k+1)/5) before step 16 = 20 - 4, then 1 - 0.9 (k - 16) / 4
    factors = [0.4, 0.6, 0.8] + [1.0] * 13 + [0.775, 0.55, 0.325, 0.1]
    assert logged_lrs(wsd(20)) == pytest.approx([LR * f for f in factors], rel=1e-12, abs=0)
    # the LR step 1 uses (before any scheduler step) is the warmup's first
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    lr_schedule(optimizer, wsd(20))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(LR / 5, rel=1e-12)


def old_cosine(optimizer, t: TrainSection):
    """The cosine schedule as `raytrain_ft.training.loop.lr_schedule` built it before `train.lr_schedule` existed."""
    warmup = max(1, min(t.warmup_steps, t.max_steps - 1))
    return torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / warmup, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(
                optimizer, T_max=max(1, t.max_steps - warmup), eta_min=t.lr * t.min_lr_ratio
            ),
        ],
        milestones=[warmup],
    )


def test_cosine_is_the_default_and_unchanged_bitwise():
    t = TrainSection(max_steps=40, warmup_steps=5, lr=LR)
    assert t.lr_schedule == "cosine"
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    assert logged_lrs(t) == logged_lrs(t, scheduler=old_cosine(optimizer, t), optimizer=optimizer)  # ==, not approx


def resumed_lrs(planned: TrainSection, extended: TrainSection, at: int) -> list[float]:
    """LRs of a run planned with `planned`, checkpointed after `at` steps (optimizer and scheduler
    state pickled, as the checkpoint holds them), restored into `extended`'s schedule and run to its end."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = lr_schedule(optimizer, planned)
    before = logged_lrs(planned, at, scheduler, optimizer)
    saved = pickle.dumps((optimizer.state_dict(), scheduler.state_dict()))
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = lr_schedule(optimizer, extended)
    optimizer_state, scheduler_state = pickle.loads(saved)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    return before + logged_lrs(extended, extended.max_steps - at, scheduler, optimizer)


def test_a_wsd_run_extended_before_its_decay_has_the_lrs_of_one_planned_longer():
    for at in (3, 12, 16):  # in the warmup, stable, the last step before the decay
        assert resumed_lrs(wsd(20), wsd(30), at) == logged_lrs(wsd(30)), at
    assert (
        extension_refusal({"train.max_steps": 20, "train.lr_schedule": "wsd", "train.decay_steps": 4}, 30, 16) is None
    )


def test_extending_a_wsd_run_during_its_decay_is_refused_and_would_differ():
    saved = {"train.max_steps": 20, "train.lr_schedule": "wsd", "train.decay_steps": 4}
    reason = extension_refusal(saved, 30, 17)
    assert reason.startswith("the run's wsd decay began after step 16 of 20 and its checkpoint is at step 17")
    assert resumed_lrs(wsd(20), wsd(30), 17) != logged_lrs(wsd(30))  # why: the LR of step 18 already fell


def test_extending_a_cosine_run_or_shortening_is_refused_with_the_reason():
    cosine = {"train.max_steps": 20, "train.lr_schedule": "cosine"}
    assert "train.lr_schedule=cosine" in extension_refusal(cosine, 30, 3)
    assert "only train.lr_schedule=wsd runs extend" in extension_refusal(cosine, 30, 3)
    wsd_fp = {"train.max_steps": 20, "train.lr_schedule": "wsd", "train.decay_steps": 4}
    assert extension_refusal(wsd_fp, 20, 3).startswith("--max-steps 20 is not beyond the planned train.max_steps=20")


def test_wsd_settings_are_validated_in_one_line():
    with pytest.raises(ConfigError, match=r"^config key 'train.lr_schedule' is 'linear'; valid: cosine, wsd$"):
        load_config(None, ["train.lr_schedule=linear"])
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.lr_schedule=wsd"])  # decay_steps left at 0
    assert "\n" not in str(e.value) and "needs 1 <= decay_steps <= max_steps - warmup_steps (90)" in str(e.value)
    assert load_config(None, ["train.lr_schedule=wsd", "train.decay_steps=20"]).train.decay_steps == 20
