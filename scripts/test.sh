#!/usr/bin/env bash
# The whole test suite: the core (.venv) and the vLLM integration (.venv-vllm).
# Extra arguments go to the core pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest "$@"
.venv-vllm/bin/python -m pytest -p no:cacheprovider tests_vllm
