"""Offline checks of the cluster launcher configs `cluster.yaml` (AWS) and `cluster-gcp.yaml` (GCP).

No cloud calls and no Ray runtime: each file goes through Ray's own offline validation, the same
two steps `ray up` starts with: `prepare_config` (merges the provider's `defaults.yaml` shipped
with Ray, merges setup commands, fills per-node-type min/max workers; it reads local files only,
no provider API) and `validate_config` (JSON schema `ray/autoscaler/ray-schema.json`, plus the
head-type and worker-count checks). `validate_config` on the raw, unprepared dict is not enough:
it requires fields that only `prepare_config` fills in (`cluster_synced_files`).

What Ray's validation does not cover, checked here directly:
- `node_config` contents are provider-specific and not checked by the schema, so the advertised
  `resources` are compared with a table of the instance types used.
- A node type with `min_workers > max_workers` is only rejected by Ray when the sum of all
  `min_workers` exceeds the global `max_workers`; a per-type inversion below that cap passes, so
  every node type's bounds are checked here too.
- The GPU node bounds times GPUs per node must equal `scaling.num_workers` of configs/gpu-7b.yaml.
"""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from jsonschema import ValidationError
from ray.autoscaler._private.util import prepare_config, validate_config

from raytrain_ft.core.config_files import load_config
from raytrain_ft.launch.ray_start import RAY_NODE_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER_FILES = ["cluster.yaml", "cluster-gcp.yaml"]
GPU_CONFIG = os.path.join(REPO, "configs", "gpu-7b.yaml")

# (vCPUs, GPUs) of the machine types the configs use: `resources` must match the hardware,
# because Ray advertises exactly what is written there.
MACHINES = {
    "m6i.2xlarge": (8, 0),
    "p4d.24xlarge": (96, 8),
    "p4de.24xlarge": (96, 8),
    "p5.48xlarge": (192, 8),
    "n2-standard-8": (8, 0),
    "a2-highgpu-8g": (96, 8),
    "a2-ultragpu-8g": (96, 8),
}


def load(name: str) -> dict:
    with open(os.path.join(REPO, name)) as f:
        return yaml.safe_load(f)


def ray_validate(raw: dict) -> dict:
    """Ray's offline validation; returns the prepared config (raises on an invalid one)."""
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    return prepared


def check_node_bounds(config: dict) -> None:
    """What Ray misses: every node type needs 0 <= min_workers <= max_workers."""
    for name, node in config["available_node_types"].items():
        lo, hi = node.get("min_workers", 0), node.get("max_workers", config["max_workers"])
        if not 0 <= lo <= hi:
            raise ValueError(f"node type {name!r}: min_workers={lo} > max_workers={hi}")


def gpu_node_type(config: dict) -> tuple[str, dict]:
    gpu_types = [(n, t) for n, t in config["available_node_types"].items() if t["resources"].get("GPU", 0) > 0]
    assert len(gpu_types) == 1, f"expected exactly one GPU node type, got {[n for n, _ in gpu_types]}"
    return gpu_types[0]


def machine_type(node: dict) -> str:
    return node["node_config"].get("InstanceType") or node["node_config"]["machineType"]


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_passes_ray_offline_validation(name):
    prepared = ray_validate(load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]
    check_node_bounds(prepared)


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_misspelled_top_level_key_fails(name):
    broken = load(name)
    broken["max_worker"] = broken.pop("max_workers")
    with pytest.raises(ValidationError, match="'max_worker' was unexpected"):
        ray_validate(broken)


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_min_workers_above_max_workers_fails(name):
    raw = load(name)
    gpu, node = gpu_node_type(raw)
    # Above the global max_workers: Ray rejects it itself.
    broken = copy.deepcopy(raw)
    broken["available_node_types"][gpu].update(min_workers=raw["max_workers"] + 1, max_workers=raw["max_workers"])
    with pytest.raises(ValueError, match="max_workers"):
        ray_validate(broken)
    # Below the global cap Ray lets it through; check_node_bounds catches it.
    broken = copy.deepcopy(raw)
    broken["available_node_types"][gpu].update(min_workers=node["max_workers"], max_workers=node["max_workers"] - 1)
    with pytest.raises(ValueError, match=f"node type '{gpu}'"):
        check_node_bounds(ray_validate(broken))


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_gpu_workers_match_the_elastic_range_of_gpu_7b(name):
    cfg = load_config(GPU_CONFIG)
    lo, hi = cfg.worker_range
    assert cfg.scaling.use_gpu
    config = ray_validate(load(name))
    _, node = gpu_node_type(config)
    gpus_per_node = node["resources"]["GPU"]
    assert gpus_per_node == 8
    assert (node["min_workers"] * gpus_per_node, node["max_workers"] * gpus_per_node) == (lo, hi) == (16, 64)
    assert config["max_workers"] >= node["max_workers"]
    # every training worker of a full node gets its CPUs
    assert gpus_per_node * cfg.scaling.cpus_per_worker <= node["resources"]["CPU"]


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_head_has_no_gpus_and_resources_match_the_machines(name):
    config = load(name)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"]["GPU"] == 0
    assert head.get("max_workers", 0) == 0
    for type_name, node in config["available_node_types"].items():
        machine = machine_type(node)
        assert machine in MACHINES, f"{type_name}: add {machine} (vCPUs, GPUs) to MACHINES"
        assert (node["resources"]["CPU"], node["resources"]["GPU"]) == MACHINES[machine], type_name
        accelerators = node["node_config"].get("guestAccelerators", [])
        if accelerators:  # GCP: the attached GPUs agree with what Ray advertises
            assert sum(a["acceleratorCount"] for a in accelerators) == node["resources"]["GPU"]


@pytest.mark.parametrize("name", CLUSTER_FILES)
def test_commands_install_the_project_and_set_nccl_env(name):
    config = load(name)
    setup = " ; ".join(config["setup_commands"] + config["worker_setup_commands"])
    assert "python3 -m venv" in setup and "pip install -q -e ." in setup
    workers = " ; ".join(config["worker_start_ray_commands"])
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in workers
    everything = yaml.safe_dump(config)
    assert "NCCL_TIMEOUT=" not in everything  # not read by PyTorch: failure.collective_timeout_s is
    # every raylet keeps idle workers for Ray Data's read tasks (RAY_NODE_ENV)
    for cmds in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        assert all(f"export {k}={v};" in " ; ".join(cmds) for k, v in RAY_NODE_ENV.items())
    assert "disabled" not in everything  # token authentication on every node, never switched off


NO_TOKEN = (
    "error: no Ray token at ~/.ray/auth_token on this node: run 'ray get-auth-token --generate' where you run "
    "ray up, then ray up again"
)


def start_node(commands: list[str], home: Path) -> tuple[int, str, list[str]]:
    """Run a node's start commands as `ray up` does (in order, until one fails) in a shell whose home is
    `home`, with a `ray` on PATH that only records its RAY_AUTH_MODE and arguments: (exit status of the
    last command run, its stderr, the recorded `ray` calls)."""
    calls, bin_dir = home.parent / "ray-calls", home.parent / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "ray"
    fake.write_text(f'#!/bin/sh\necho "$RAY_AUTH_MODE $*" >> {calls}\n')
    fake.chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin", "RAY_HEAD_IP": "10.0.0.1"}
    for command in commands:
        r = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=30)
        if r.returncode:
            break
    recorded = calls.read_text().splitlines() if calls.exists() else []
    calls.unlink(missing_ok=True)
    return r.returncode, r.stderr, recorded


@pytest.mark.parametrize("name", CLUSTER_FILES)
@pytest.mark.parametrize("node", ["head_start_ray_commands", "worker_start_ray_commands"])
def test_a_node_without_a_ray_token_refuses_in_one_line_and_starts_ray_with_token_auth(name, node, tmp_path):
    commands = ray_validate(load(name))[node]  # as `ray up` renders them
    home = tmp_path / "home"
    home.mkdir()
    rc, stderr, calls = start_node(commands, home)
    assert (rc, stderr.strip().splitlines(), calls) == (1, [NO_TOKEN], [" stop"])  # never `ray start`
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("")  # an empty token is no token
    assert start_node(commands, home)[:2] == (1, NO_TOKEN + "\n")
    (home / ".ray" / "auth_token").write_text("0123456789abcdef0123456789abcdef")
    rc, stderr, calls = start_node(commands, home)
    assert rc == 0, stderr
    assert calls[-1].startswith("token start ")
