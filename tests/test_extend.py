"""Extending a wsd run on purpose (`raytrain-ft extend`), and `raytrain-ft runs`, with real DCP
checkpoints and a real SQLite MLflow store. The runs train on the Ray-free session (`tests/local_run.py`);
the refused resubmission goes through the driver (`raytrain_ft.launch.driver.run`), whose preflight
refuses it before any worker starts."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from conftest import assert_resumed, assert_same_state, final_state, make_config, metric_by_step, run_root
from local_run import LocalRunFailed, local_run
from raytrain_ft.checkpoint.reader import newest_checkpoint
from raytrain_ft.cli import main
from raytrain_ft.core.errors import CheckpointError
from raytrain_ft.launch.driver import run

pytestmark = pytest.mark.usefixtures("ray_local")

# tiny.yaml warms up over 5 steps; planned for 20 the decay begins after step 14, for 30 after step 24
WSD = ("train.lr_schedule=wsd", "train.decay_steps=6", "checkpoint.interval_steps=4")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One folder (run folders and MLflow store) for every run of this module."""
    return tmp_path_factory.mktemp("extend")


@pytest.fixture(scope="module")
def planned_30(store, dataset):
    """A wsd run planned for 30 steps from the start: what an extended run must equal."""
    cfg = make_config(store, dataset, "run.name=wsd30", "train.max_steps=30", *WSD)
    return cfg, local_run(cfg)


@pytest.fixture(scope="module")
def extended(store, dataset):
    """A wsd run planned for 20 steps that stops after committing step 12 (an exception at step 13
    with no restarts left), is resubmitted for 30 steps (refused), extended to 30 and resubmitted.
    Returns (config, MLflow run id, the refusal's message)."""
    fault = "faults=[{kind: raise, step: 13, rank: 0}]"
    first = make_config(store, dataset, "run.name=wsd20", "train.max_steps=20", "failure.max_failures=0", fault, *WSD)
    with pytest.raises(LocalRunFailed, match="InjectedFault"):
        local_run(first)
    longer = make_config(store, dataset, "run.name=wsd20", "train.max_steps=30", fault, *WSD)  # the fault fired once
    with pytest.raises(CheckpointError) as refused:
        run(longer)  # the driver's preflight: no worker starts
    assert main(["extend", "wsd20", "--max-steps", "30", "--tracking-uri", longer.tracking.uri]) == 0
    return longer, local_run(longer), str(refused.value)


def test_a_wsd_run_extended_at_step_12_ends_as_the_run_planned_for_30(extended, planned_30):
    cfg, run_id, _ = extended
    ref_cfg, ref_run = planned_30
    assert_resumed(cfg.tracking.uri, run_id, [0, 12])
    assert_same_state(final_state(cfg, 30), final_state(ref_cfg, 30))
    lrs = metric_by_step(cfg, run_id, "train/lr")
    assert sorted(lrs) == list(range(1, 31)) and lrs == metric_by_step(ref_cfg, ref_run, "train/lr")
    assert lrs[30] < lrs[24] == lrs[13]  # it did decay, after step 24, as planned for 30
    assert metric_by_step(cfg, run_id, "train/loss") == metric_by_step(ref_cfg, ref_run, "train/loss")
    _, meta = newest_checkpoint(run_root(cfg))  # the checkpoint's fingerprint history
    assert meta.fingerprint["train.max_steps"] == 30
    assert meta.history == [{"at_step": 12, "from_max_steps": 20, "max_steps": 30}]


def test_a_resubmission_with_a_new_max_steps_and_no_extend_is_refused_naming_extend(extended):
    message = extended[2]
    assert "\n" not in message
    assert "was planned for train.max_steps=20 but the config says 30; to train a wsd run further run " in message
    assert "`raytrain-ft extend wsd20 --max-steps 30` first" in message


def test_extending_a_run_whose_decay_ran_is_refused_in_one_line(extended, capsys):
    cfg = extended[0]
    assert main(["extend", "wsd20", "--max-steps", "40", "--tracking-uri", cfg.tracking.uri]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the run's wsd decay began after step 24 of 30 and its checkpoint is at step 30" in err


def test_runs_lists_each_run_with_its_progress_loss_restarts_and_goodput(extended, planned_30, capsys):
    cfg, run_id, _ = extended
    ref_cfg, ref_run = planned_30
    assert main(["runs", "--tracking-uri", cfg.tracking.uri]) == 0
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in capsys.readouterr().out.splitlines()
        if line.count("│") == 8
    }
    client = MlflowClient(cfg.tracking.uri)
    # "0" for both: local runs record no `failure` events, so no `restarts` metric (Ray's controller callback
    # records them; the column's value from a logged metric: tests/unit/test_extend_command.py)
    for name, rid, restarts in (("wsd20", run_id, "0"), ("wsd30", ref_run, "0")):
        m = client.get_run(rid).data.metrics
        val_loss = (
            f"{m['train/val_loss']:.4f}" if "train/val_loss" in m else ""
        )  # blank while the run validates nothing
        assert rows[name] == [
            "FINISHED",
            "30/30",
            f"{m['train/loss']:.4f}",
            val_loss,
            restarts,
            f"{m['goodput']:.3f}",
        ], name
    assert set(rows) == {"wsd20", "wsd30"}
