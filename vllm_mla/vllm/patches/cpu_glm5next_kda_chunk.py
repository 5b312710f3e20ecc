"""Patch GLM-5.3-Flash's KDA prefill for CPU tensors.

Target: ``vllm.models.glm5next.common.kda.chunk_kda_with_fused_gate(q, k, v, raw_g, beta,
A_log, g_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
cu_seqlens, safe_gate, lower_bound, **kwargs)`` (vLLM 0.32, 0.33, 0.34), feature
``sparse-cpu``, CPU platform only, applied when that module is imported.
Why: GLM-5.3-Flash's KDA prefill (the chunked delta rule with its gate fused) is Triton,
which vLLM CPU runs without. vLLM CPU serves Qwen3-Next's gated delta net with CPU ops of
its own, but not KDA, so a GLM-5.3-Flash checkpoint with its KDA layers stops at its first
prefill.
How: CPU tensors go to ``vllm_mla.ops.kda.reference.chunk_with_fused_gate`` (vLLM's
recurrence in fp32, its ``[H, V, K]`` state layout; telemetry ``kda:chunk:cpu``);
everything else to the original. The unbounded gate (``safe_gate=False``) and q/k without
the in-kernel L2 norm are not served: ``KDAError`` naming the setting.
Removal: when vLLM CPU serves KDA layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from vllm_mla.ops.kda import reference
from vllm_mla.vllm import telemetry


def on_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def require(served: bool, setting: str) -> None:
    if not served:
        raise reference.KDAError(f"KDA on CPU: {setting} is not served (vllm_mla.ops.kda)")


def arguments_of(original: Callable) -> Callable[[tuple, dict], dict]:
    """A call's arguments by ``original``'s parameter names, its defaults filled in (the
    kernel wrapper's own defaults, whatever the vLLM version)."""
    signature = inspect.signature(original)

    def bind(args: tuple, kwargs: dict) -> dict:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    return bind


def make_chunk_kda_with_fused_gate(original: Callable) -> Callable:
    """The replacement for ``chunk_kda_with_fused_gate``."""
    bind = arguments_of(original)

    def chunk_kda_with_fused_gate(*args, **kwargs):
        a = bind(args, kwargs)
        if not on_cpu(a["q"], a["initial_state"]):
            return original(*args, **kwargs)
        lower_bound = a["lower_bound"]
        require(a["safe_gate"] and lower_bound is not None, "safe_gate=False (the unbounded gate)")
        require(a["use_qk_l2norm_in_kernel"], "use_qk_l2norm_in_kernel=False")
        telemetry.record_sparse("kda:chunk:cpu")
        o, final = reference.chunk_with_fused_gate(
            *(a[n] for n in ("q", "k", "v", "raw_g", "beta", "A_log", "g_bias", "scale")),
            a["initial_state"],
            a["cu_seqlens"],
            lower_bound,
        )
        return o, (final if a["output_final_state"] else None)

    return chunk_kda_with_fused_gate
