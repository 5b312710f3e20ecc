"""Patch GLM-5.3-Flash's KDA decode for CPU tensors.

Target: ``vllm.models.glm5next.common.kda.fused_recurrent_kda(q, k, v, g, beta, scale,
initial_state, inplace_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
ssm_state_indices, num_accepted_tokens, out, sigmoid_beta, a_log, g_bias, compute_gate,
lower_bound, **kwargs)`` (vLLM 0.32, 0.33, 0.34), feature ``sparse-cpu``, CPU platform
only, applied when that module is imported.
Why: GLM-5.3-Flash's KDA decode and speculative verification are one Triton kernel, which
vLLM CPU runs without.
How: CPU tensors go to ``vllm_mla.ops.kda.reference.fused_recurrent`` (the kernel's state
slots, its start at the last accepted token, its null-slot rule, the gate and beta sigmoid
computed in place of ``compute_gate`` / ``sigmoid_beta``; telemetry
``kda:recurrent:cpu``); everything else to the original. An out-of-place final state or a
call without the cache is not served: ``KDAError`` naming the setting.
Removal: when vLLM CPU serves KDA layers.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.ops.kda import reference
from vllm_mla.vllm import telemetry
from vllm_mla.vllm.patches.cpu_glm5next_kda_chunk import arguments_of, on_cpu, require


def make_fused_recurrent_kda(original: Callable) -> Callable:
    """The replacement for ``fused_recurrent_kda``."""
    bind = arguments_of(original)

    def fused_recurrent_kda(*args, **kwargs):
        a = bind(args, kwargs)
        state = a["initial_state"]
        if not on_cpu(a["q"], state):
            return original(*args, **kwargs)
        require(a["inplace_final_state"], "inplace_final_state=False")
        require(a["use_qk_l2norm_in_kernel"], "use_qk_l2norm_in_kernel=False")
        require(
            state is not None
            and a["ssm_state_indices"] is not None
            and a["cu_seqlens"] is not None,
            "a call without the cache (initial_state, ssm_state_indices and cu_seqlens)",
        )
        telemetry.record_sparse("kda:recurrent:cpu")
        o = reference.fused_recurrent(
            *(a[n] for n in ("q", "k", "v", "g", "beta")),
            state,
            a["ssm_state_indices"],
            a["cu_seqlens"],
            scale=a["scale"],
            num_accepted_tokens=a["num_accepted_tokens"],
            a_log=a["a_log"] if a["compute_gate"] else None,
            g_bias=a["g_bias"],
            lower_bound=a["lower_bound"],
            sigmoid_beta=a["sigmoid_beta"],
            out=a["out"],
        )
        return o, state

    return fused_recurrent_kda
