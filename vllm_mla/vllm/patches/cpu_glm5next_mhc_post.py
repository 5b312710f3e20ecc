"""Patch GLM-5.3-Flash's last mHC post block on CPU to run on every host.

Target: ``vllm.models.glm5next.common.model.Glm5NextDecoderLayer.hc_post(self, x,
residual, post, comb)`` (vLLM 0.32, 0.33, 0.34), feature ``sparse-cpu``, CPU platform
only, applied when that module is imported.
Why: ``MHCPostOp.forward_cpu`` calls the ``_C`` library's ``hc_post_fused_cpu``, which
``_C_AVX2`` and ``_C_AVX512`` lack, so the last mHC layer fails on those hosts.
How: for CPU tensors the original runs with the op answered by its torch
``forward_native`` (vLLM's ``mhc_post_torch``; telemetry ``mhc:post:cpu``); everything
else to the original.
Removal: when vLLM CPU's mHC post op runs on every host it loads.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.vllm import telemetry
from vllm_mla.vllm.patches.cpu_glm5next_mhc_pre import native_op


def make_hc_post(original: Callable) -> Callable:
    """The replacement for ``Glm5NextDecoderLayer.hc_post``."""

    def hc_post(self, x, residual, post, comb):
        if x.device.type != "cpu":
            return original(self, x, residual, post, comb)
        telemetry.record_sparse("mhc:post:cpu")
        with native_op(self, "mhc_post_op"):
            return original(self, x, residual, post, comb)

    return hc_post
