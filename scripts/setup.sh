#!/usr/bin/env bash
# Creates (or refreshes) the project environment in .venv at the repository root.
#   bash scripts/setup.sh          runtime: torch, safetensors, rich, vllm-mla (editable)
#   bash scripts/setup.sh --test   the same plus pytest, ruff, triton, and a second
#                                  environment .venv-vllm with vllm==0.33.0 for the
#                                  integration tests (first run ~4 min, ~9.4 GB)
# Idempotent: a second run reinstalls nothing unless pyproject.toml, setup.py or csrc/ changed.
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

[[ -x .venv/bin/python ]] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

# torch first, pinned where it matters: without a GPU the 2.13.0 CPU wheel (local on
# this kind of machine, seconds); with one, the newest CUDA build the range allows.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" install "torch>=2.13,<2.15"
  else
    "${pip[@]}" install "torch==2.13.0"
  fi
fi

stamp=".venv/.vllm-mla-installed${extras}"
want="$(cat pyproject.toml setup.py csrc/* | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  # No build isolation: setup.py must see the installed torch to decide on the CUDA op.
  "${pip[@]}" install "setuptools>=68" wheel
  "${pip[@]}" install --no-build-isolation -e ".${extras}"
  .venv/bin/python -c "import vllm_mla.cli" # fail here, not later, if the install broke
  echo "$want" > "$stamp"
fi

if [[ -n "$extras" ]]; then
  [[ -x .venv-vllm/bin/python ]] || "$python" -m venv .venv-vllm
  vpip=(.venv-vllm/bin/python -m pip --disable-pip-version-check -q)
  if ! .venv-vllm/bin/python -c "import vllm, pytest" 2>/dev/null; then
    "${vpip[@]}" install "vllm==0.33.0" pytest "setuptools>=68"
  fi
  vstamp=".venv-vllm/.vllm-mla-installed"
  if [[ ! -f "$vstamp" || "$(cat "$vstamp")" != "$want" ]]; then
    # The CUDA op is not needed for the CPU integration tests.
    VLLM_MLA_CUDA_ARCHS=none "${vpip[@]}" install --no-deps --no-build-isolation -e .
    echo "$want" > "$vstamp"
  fi
fi
