"""Patch DeepSeek-V4's CUDA attention selector to refuse, at start-up, a GPU its attention
backends declare they cannot run on.

Target: ``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls(vllm_config)`` (vLLM
0.32, 0.33, 0.34), feature ``dsv4-gpu``, CUDA platform only, applied when that module is
imported.
Why: the selector picks FlashMLA's class on every GPU that is not SM12x, SM80 / SM89
included, and nothing checks the backends' own ``supports_compute_capability`` (FlashMLA's
sparse DSV4 backend declares 9.x / 10.x, FlashInfer's 10.x / 12.x): V4 then fails inside
a kernel at the first step (DeepGEMM's "Unsupported architecture", Triton's "type fp8e4nv
not supported in this architecture", FlashMLA's "Unsupported architecture for sparse
decode fwd"), after the weights are loaded.
How: after the original picks a class, its backend's declaration is asked about the
device; when it declines, one ``ValueError`` names the device's capability, the class
and backend picked, the attention-backend setting, and what every V4 attention class's
backend declares (majors 7 to 12 asked), so a user sees which setting or GPU serves V4.
Removal: when vLLM's V4 selector checks its backends' declared capabilities.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

MODULE = "vllm.models.deepseek_v4.nvidia.model"
# The classes the selector returns (each a DeepseekV4Attention with a ``backend_cls``).
CLASSES = (
    "DeepseekV4FlashMLAAttention",
    "DeepseekV4FlashInferMLAAttention",
    "DeepseekV4FlashInferSM120Attention",
)
MAJORS = range(7, 13)  # Volta to Blackwell consumer: what each backend is asked about


def declared_majors(attn_cls: type) -> list[int]:
    """The compute-capability majors ``attn_cls``'s backend declares it runs on."""
    from vllm.platforms.interface import DeviceCapability

    backend = attn_cls.backend_cls
    return [m for m in MAJORS if backend.supports_compute_capability(DeviceCapability(m, 0))]


def refusal(chosen: type, capability, backend_setting) -> str | None:
    """Why ``chosen`` cannot serve a GPU of ``capability`` (None: it declares it can)."""
    if capability is None or chosen.backend_cls.supports_compute_capability(capability):
        return None
    module = sys.modules[MODULE]
    declared = []
    for name in CLASSES:
        cls = getattr(module, name, None)
        if cls is not None:
            majors = " / ".join(f"{m}.x" for m in declared_majors(cls)) or "none"
            declared.append(f"{name} ({cls.backend_cls.get_name()}): {majors}")
    setting = getattr(backend_setting, "name", backend_setting) or "auto"
    return (
        f"DeepSeek-V4 cannot run on this GPU (compute capability {capability.major}."
        f"{capability.minor}): vLLM picked {chosen.__name__} ({chosen.backend_cls.get_name()}) "
        f"for attention backend {setting}, and its backend declares it does not run here. "
        f"What vLLM's V4 attention classes declare: {'; '.join(declared)}. (vllm-mla's "
        "portable V4 kernels, Triton for SM80+, are not wired into vLLM's GPU V4 path yet.)"
    )


def make_select(original: Callable) -> Callable:
    """The replacement for ``_select_dsv4_attn_cls``."""

    def _select_dsv4_attn_cls(vllm_config):
        chosen = original(vllm_config)
        platform = sys.modules[MODULE].current_platform
        why = refusal(
            chosen, platform.get_device_capability(), vllm_config.attention_config.backend
        )
        if why is not None:
            raise ValueError(why)
        return chosen

    return _select_dsv4_attn_cls
