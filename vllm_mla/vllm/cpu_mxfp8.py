"""Feature ``cpu-mxfp8``: MXFP8 linear layers (e.g. an MXFP8 kv_b_proj) load on vLLM CPU.

vLLM's MXFP8 kernel table has no CPU entry, so any MXFP8 checkpoint fails on CPU with
"Failed to find a kernel that can implement the MXFP8 linear layer". vLLM's own
``EmulationMxfp8LinearKernel`` is platform-neutral torch (dequantize, then a plain
linear); vLLM's extension API ``register_linear_kernel(kernel, PlatformEnum.CPU,
"mxfp8")`` makes it the CPU choice. With ``VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=0`` it
keeps the e4m3 values and E8M0 scales (form ``mxfp8``, which direct mode serves); by
default it dequantizes at load (form ``mxfp8-emulation``, a BF16 weight). Once per
process, on a CPU platform only.
"""

from __future__ import annotations

_registered: str | None = None


def register() -> str:
    """Register vLLM's emulation MXFP8 kernel for the CPU platform (once); what happened."""
    global _registered
    if _registered is not None:
        return _registered
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        _registered = "skipped: for cpu only"
        return _registered
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel

    register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")
    _registered = "registered EmulationMxfp8LinearKernel for CPU (register_linear_kernel)"
    return _registered
