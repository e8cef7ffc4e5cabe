"""The README is the product's front door: its commands must exist and its reference must match the code."""

from __future__ import annotations

import os
import re
from pathlib import Path

from conftest import REPO
from raytrain_ft.config import load_config, reference_markdown, valid_keys

README = Path(REPO, "README.md").read_text()
CONFIG_REFERENCE = Path(REPO, "docs", "configuration.md").read_text()


def test_config_reference_is_the_generated_one():
    start = CONFIG_REFERENCE.index("-->\n", CONFIG_REFERENCE.index("<!-- config-reference:start")) + 4
    end = CONFIG_REFERENCE.index("<!-- config-reference:end -->")
    assert CONFIG_REFERENCE[start:end] == reference_markdown()


def test_every_config_key_is_documented():
    for key in valid_keys():
        assert f"`{key}`" in CONFIG_REFERENCE, key


def test_readme_commands_name_existing_files():
    paths = set(re.findall(r"\b((?:scripts|jobs|benchmarks|configs)/[\w./-]+\.(?:sh|py|yaml))", README))
    paths |= set(re.findall(r"\b(cluster(?:-gcp)?\.yaml)\b", README))
    assert {
        "scripts/demo.sh",
        "scripts/test.sh",
        "jobs/pretrain.py",
        "jobs/prepare_data.py",
        "configs/gpu-7b.yaml",
        "cluster.yaml",
    } <= paths
    for path in paths:
        assert os.path.exists(os.path.join(REPO, path)), path
    for config in (p for p in paths if p.startswith("configs/")):
        load_config(os.path.join(REPO, config))  # every shipped config is valid
