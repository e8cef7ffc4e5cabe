import pytest

from raytrain_ft.core.config import valid_keys
from raytrain_ft.core.config_files import from_dict, load_config, to_dict
from raytrain_ft.core.errors import ConfigError


def test_defaults_and_overrides_merge():
    cfg = load_config(
        None, ["train.max_steps=7", "scaling.num_workers=[1,3]", "faults=[{kind: kill, step: 3, rank: 1}]"]
    )
    assert cfg.train.max_steps == 7
    assert cfg.worker_range == (1, 3)
    assert cfg.faults[0].kind == "kill" and cfg.faults[0].rank == 1
    assert from_dict(to_dict(cfg)) == cfg


def test_unknown_key_names_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.max_step'; did you mean 'train\.max_steps'\?"):
        load_config(None, ["train.max_step=5"])


def test_a_misspelled_section_names_the_closest_section():
    with pytest.raises(ConfigError, match=r"^unknown config section 'trian'; did you mean 'train'\?$"):
        load_config(None, ["trian.max_steps=5"])


def test_an_override_without_a_value_says_so():
    with pytest.raises(
        ConfigError, match=r"^override 'train\.max_steps' has no value; write it as train\.max_steps=VALUE$"
    ):
        load_config(None, ["train.max_steps"])


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"config key 'train\.max_steps'.*'abc'"):
        load_config(None, ["train.max_steps=abc"])


@pytest.mark.parametrize("bad", ["scaling.num_workers=[3,1]", "scaling.num_workers=0", "train.global_batch_size=0"])
def test_invalid_values(bad):
    with pytest.raises(ConfigError):
        load_config(None, [bad])


def test_unknown_fault_kind():
    with pytest.raises(ConfigError, match="valid kinds: raise, kill, nan"):
        load_config(None, ["faults=[{kind: boom, step: 3}]"])


def test_valid_keys_cover_the_contract():
    for key in [
        "run.name",
        "run.storage_path",
        "data.path",
        "model.preset",
        "model.dropout",
        "train.max_steps",
        "train.global_batch_size",
        "train.micro_batch_size",
        "train.seq_len",
        "train.seed",
        "train.lr",
        "scaling.num_workers",
        "scaling.use_gpu",
        "checkpoint.interval_steps",
        "checkpoint.num_to_keep",
        "failure.max_failures",
        "tracking.uri",
        "tracking.experiment",
        "faults",
    ]:
        assert key in valid_keys()


def test_yaml_syntax_error_and_wrong_shape_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {max_steps: [\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError):
        load_config(str(listy))


def test_spike_warmup_longer_than_window_is_refused():
    with pytest.raises(ConfigError, match="1 <= warmup <= window"):
        load_config(None, ["guards.spike.window=50"])


def test_failure_recovery_defaults_to_restart_and_refuses_unknown_modes():
    assert load_config(None, []).failure.recovery == "restart"
    assert load_config(None, ["failure.recovery=replica"]).failure.recovery == "replica"
    with pytest.raises(ConfigError, match=r"^config key 'failure\.recovery' is 'replicas'; valid: restart, replica$"):
        load_config(None, ["failure.recovery=replicas"])


def test_a_fault_moment_the_kind_does_not_have_is_refused_in_one_line():
    assert load_config(None, ["faults=[{kind: raise, at: save, step: 5}]"]).faults[0].at == "save"
    with pytest.raises(
        ConfigError, match=r"^config key 'faults\[0\]\.at' is 'start'; valid for kill: save, write, metadata$"
    ):
        load_config(None, ["faults=[{kind: kill, at: start, step: 5}]"])
    with pytest.raises(ConfigError, match=r"^config key 'faults\[0\]\.at' is 'write'; valid for raise: save$"):
        load_config(None, ["faults=[{kind: raise, at: write, step: 5}]"])
    with pytest.raises(ConfigError, match=r"^config key 'faults\[0\]\.rank' is 1 for a kill at metadata; only rank 0"):
        load_config(None, ["faults=[{kind: kill, at: metadata, step: 5, rank: 1}]"])
    with pytest.raises(ConfigError, match=r"^config key 'faults\[0\]\.at' is 'save'; nan takes no 'at'$"):
        load_config(None, ["faults=[{kind: nan, at: save, step: 5}]"])
