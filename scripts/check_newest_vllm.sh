#!/usr/bin/env bash
# Is the next vLLM release a surprise? Installs the newest vLLM on the package index (or
# VERSION) into a scratch environment, installs this plugin beside it, and prints per
# feature whether it would apply and, where not, which patch target moved
# (`vllm-mla check-vllm`). The plugin itself applies nothing on a version it does not know
# (one warning); this says what porting it would take. Exit 0: every target is in place.
#   bash scripts/check_newest_vllm.sh [VERSION] [VENV]   (VENV default: a new temp folder)
# About 3-4 min and ~9.5 GB on a first run; the environment is kept for a second look.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3

version="${1:-$("$python" scripts/vllm_env.py newest)}"
venv="${2:-$(mktemp -d)/vllm-$version}"
echo "vLLM $version into $venv"
"$python" scripts/vllm_env.py install "$venv" "$version" "setuptools>=68"
VLLM_MLA_CUDA_ARCHS=none "$venv/bin/python" -m pip --disable-pip-version-check -q \
  install --no-deps --no-build-isolation -e .
rm -rf vllm_mla.egg-info
# CPU platform mode: the check imports vLLM's modules and reads signatures, runs nothing
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -m vllm_mla.tools.cli check-vllm
