"""Preflight refuses `failure.recovery: replica` where Ray Train 2.60's replica groups cannot run it."""

import pytest

from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.errors import ConfigError
from raytrain_ft.training.preflight import check_recovery


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["scaling.num_workers=[1,2]"], r"^failure\.recovery=replica needs a fixed scaling\.num_workers, got \[1, 2\]"),
        (
            ["parallel.strategy=fsdp"],
            r"^failure\.recovery=replica needs parallel\.strategy=ddp, got fsdp \(from fsdp\)",
        ),
        (["parallel.strategy=hsdp"], r"^failure\.recovery=replica needs parallel\.strategy=ddp, got hsdp"),
        (["scaling.use_gpu=true"], r"^failure\.recovery=replica needs parallel\.strategy=ddp, got fsdp \(from auto\)"),
    ],
)
def test_replica_recovery_refuses_elastic_and_sharded_runs_in_one_line(overrides, message):
    cfg = load_config(None, ["failure.recovery=replica", *overrides])
    with pytest.raises(ConfigError, match=message) as e:
        check_recovery(cfg)
    assert "\n" not in str(e.value)


def test_replica_recovery_passes_with_fixed_ddp_workers_and_restart_passes_anything():
    check_recovery(load_config(None, ["failure.recovery=replica", "scaling.num_workers=3", "parallel.strategy=ddp"]))
    check_recovery(load_config(None, ["scaling.num_workers=[1,2]", "parallel.strategy=fsdp"]))


def test_replica_recovery_without_torchft_names_the_extra(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^failure\.recovery=replica needs torchft: pip install -e '\.\[ft\]'$"):
        check_recovery(load_config(None, ["failure.recovery=replica"]))
