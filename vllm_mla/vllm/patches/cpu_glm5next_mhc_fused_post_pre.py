"""Patch GLM-5.3-Flash's fused mHC post + pre block on CPU so the norm is applied.

Target: ``vllm.models.glm5next.common.model.Glm5NextDecoderLayer.hc_fused_post_pre(self,
x, residual, post, comb, hc_fn, hc_scale, hc_base, norm_weight, norm_eps)`` (vLLM 0.32,
0.33, 0.34), feature ``sparse-cpu``, CPU platform only, applied when that module is
imported.
Why: as for ``cpu_glm5next_mhc_pre``: ``MHCFusedPostPreOp``'s CPU and native paths
return the next block's input without the RMSNorm the layer passes (its
``post_attention_layernorm`` before the MLP, the next layer's ``input_layernorm``), and
its CPU op is in ``_C`` only (vLLM 0.33, 0.34).
How: for CPU tensors the original runs with the op answered by its torch
``forward_native`` (vLLM's ``mhc_post_torch`` then ``mhc_pre_torch``), then vLLM's
``_apply_mhc_norm`` normalizes the layer input (telemetry ``mhc:fused_post_pre:cpu``);
everything else to the original.
Removal: when vLLM's CPU mHC ops apply ``norm_weight``.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.vllm import telemetry
from vllm_mla.vllm.patches.cpu_glm5next_mhc_pre import native_op, normed


def make_hc_fused_post_pre(original: Callable) -> Callable:
    """The replacement for ``Glm5NextDecoderLayer.hc_fused_post_pre``."""

    def hc_fused_post_pre(
        self, x, residual, post, comb, hc_fn, hc_scale, hc_base, norm_weight=None, norm_eps=0.0
    ):
        args = (x, residual, post, comb, hc_fn, hc_scale, hc_base, norm_weight, norm_eps)
        if x.device.type != "cpu":
            return original(self, *args)
        telemetry.record_sparse("mhc:fused_post_pre:cpu")
        with native_op(self, "mhc_fused_post_pre_op"):
            residual, post, comb, layer_input = original(self, *args)
        return residual, post, comb, normed(layer_input, norm_weight, norm_eps)

    return hc_fused_post_pre
