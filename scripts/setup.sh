#!/usr/bin/env bash
# Create .venv and install raytrain-ft with its test tools. On a machine without an NVIDIA GPU,
# torch is pinned to the CPU build first (PyPI's Linux torch is a multi-GB CUDA build): from PyTorch's
# CPU index, or, where that index cannot be reached, the pinned release from pip's own sources (a
# mirror or a local wheel that pip's configuration names).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  .venv/bin/python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu --retries 0 --timeout 15 \
    || .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[dev,ft]"  # ft: torchft, for failure.recovery=replica
