#!/usr/bin/env bash
# Install (if needed), lint, and run the whole test suite on a real local Ray instance.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff format --check raytrain_ft jobs tests benchmarks scripts
.venv/bin/ruff check raytrain_ft jobs tests benchmarks scripts
.venv/bin/mypy  # the package; settings in pyproject.toml [tool.mypy]
# two test processes on 2 cores: the long Ray scenarios one after another on one, the other files on
# the other (tests/conftest.py: pytest_collection_modifyitems); collection order, not the largest file first
.venv/bin/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder "$@"
