"""What vLLM's CUDA wheel lacks when its classes run in CPU platform mode, and the stand-ins.

A test and benchmark harness, never applied by the plugin. The vLLM-class tests and the
CPU smoke runs of the GPU benchmarks run the CUDA wheel (vLLM 0.33 / 0.34) with
``VLLM_TARGET_DEVICE=cpu``:
vLLM's CPU platform decides, but the kernels vLLM CPU ships (its ``_C`` libraries,
triton-cpu) are not there. Two of vLLM's CPU decisions would then ask for what the build
cannot give, and depend on the host:

- **GEMM binding (AMX hosts).** ``dispatch_cpu_unquantized_gemm`` (``layers/utils.py``)
  binds a small bf16/fp16 linear to sgl-kernel's packed GEMM where ``check_cpu_sgl_kernel``
  says so, which needs AMX tiles; that path calls ``torch.ops._C.convert_weight_packed``,
  an op of vLLM CPU's ``_C`` only. On an AMX host the CUDA wheel raised AttributeError in
  every linear post-load; elsewhere it bound oneDNN or ``F.linear``. Stand-in: where this
  build has no ``convert_weight_packed``, the SGL gate answers False, so the dispatcher
  binds what the build can run (as on a host without AMX). vLLM CPU keeps its own gate.
- **Triton gate (vLLM 0.34).** ``CpuPlatform.check_and_update_config`` raises "vLLM on x86
  CPUs requires Triton (triton-cpu)" where ``vllm.triton_utils.HAS_TRITON`` is False, and
  it is False for the CUDA wheel on a machine without a GPU (no active Triton driver;
  triton-cpu is not on the package index). Stand-in: that one call reads the flag as True;
  every other reader keeps vLLM's value, and nothing here runs a Triton kernel on CPU.

``install()`` applies what the installed build needs (nothing on vLLM CPU, nothing on a
CUDA platform) and returns the names applied; ``tests_vllm/test_cpu_platform_mode.py``
pins both targets and shows each stand-in is needed.
"""

from __future__ import annotations

import functools
import inspect

SGL_GATE = ("vllm.model_executor.layers.utils", "check_cpu_sgl_kernel")
TRITON_GATE = ("vllm.platforms.cpu", "CpuPlatform.check_and_update_config")
_installed: list[str] = []
_originals: dict[tuple[str, str], object] = {}  # target -> what vLLM had there


def is_cuda_wheel() -> bool:
    """No vLLM CPU kernel library loads in this process: vLLM's CUDA wheel."""
    from vllm.platforms import current_platform

    from vllm_mla.vllm import cpu_host

    current_platform.import_kernels()
    return not cpu_host.loaded_libraries()


def has_sgl_kernels() -> bool:
    """This vLLM build has sgl-kernel's CPU GEMM (vLLM CPU's ``_C``), once kernels load."""
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return hasattr(torch.ops._C, "convert_weight_packed")


def triton_gate_closed() -> bool:
    """vLLM's CPU platform would refuse this process for want of triton-cpu."""
    from vllm.platforms.cpu import CpuArchEnum, CpuPlatform

    source = inspect.getsource(CpuPlatform.check_and_update_config)
    if "requires Triton" not in source:
        return False  # vLLM 0.32 / 0.33: no such gate
    import vllm.triton_utils as triton_utils

    return not triton_utils.HAS_TRITON and CpuPlatform.get_cpu_architecture() == CpuArchEnum.X86


def _no_sgl_gate(n: int, k: int, dtype) -> bool:
    return False


def _lift_triton_gate(original):
    """``check_and_update_config`` with ``HAS_TRITON`` read as True during the call."""
    import vllm.triton_utils as triton_utils

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        kept = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            return original(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = kept

    return classmethod(check_and_update_config)


def install() -> list[str]:
    """Apply the stand-ins this build needs (once per process); returns their names."""
    if _installed:
        return list(_installed)
    import importlib

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []

    if is_cuda_wheel() and not has_sgl_kernels():
        utils = importlib.import_module(SGL_GATE[0])
        _originals[SGL_GATE] = getattr(utils, SGL_GATE[1])
        setattr(utils, SGL_GATE[1], _no_sgl_gate)
        _installed.append("sgl-gemm-gate")
    if triton_gate_closed():
        from vllm.platforms.cpu import CpuPlatform

        original = CpuPlatform.check_and_update_config.__func__
        _originals[TRITON_GATE] = original
        CpuPlatform.check_and_update_config = _lift_triton_gate(original)
        _installed.append("triton-gate")
    return list(_installed)


def installed() -> list[str]:
    return list(_installed)


def original(target: tuple[str, str]) -> object:
    """What vLLM had at ``target`` before its stand-in (KeyError: none was installed)."""
    return _originals[target]
