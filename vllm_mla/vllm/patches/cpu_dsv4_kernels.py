"""Patch DeepSeek-V4's CPU model: our torch V4 kernels where vLLM's are absent, or a stop.

Target: ``vllm.models.deepseek_v4.cpu.model.DeepseekV4ForCausalLM.__init__(self, *,
vllm_config, prefix="")`` (vLLM 0.32, 0.33, 0.34), feature ``sparse-cpu``, CPU platform
only, applied when that module is imported.
Why: vLLM CPU's V4 kernels are in its ``_C`` library only (AVX-512 BF16 hosts); on a host
that loads ``_C_AVX2`` or ``_C_AVX512`` the model builds, then stops while processing its
weights with ``'_OpNamespace' '_C' object has no attribute 'convert_weight_packed'``.
How: before the original runs, ``sparse.dsv4_cpu.refusal()``: it defines our torch
kernels (``sparse.dsv4_ops``) for those the loaded library lacks, and names any still
missing (the library loaded, the ISA cap, the kernels), raised as a ``ValueError``; where
nothing is missing, the original alone.
Removal: when vLLM CPU's V4 kernels are built into every library it loads.
"""

from __future__ import annotations

from collections.abc import Callable


def make_init(original: Callable) -> Callable:
    """The replacement for ``DeepseekV4ForCausalLM.__init__``."""
    from vllm_mla.vllm.sparse import dsv4_cpu

    def __init__(self, *, vllm_config, prefix=""):
        reason = dsv4_cpu.refusal()
        if reason is not None:
            raise ValueError(reason)
        original(self, vllm_config=vllm_config, prefix=prefix)

    return __init__
