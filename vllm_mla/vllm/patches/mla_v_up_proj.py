"""Patch ``MLAAttention._v_up_proj`` to use ``safe_mla_query_bmm`` where it is needed.

Target: ``vllm.model_executor.layers.attention.mla_attention.MLAAttention
._v_up_proj(self, x, out)`` (vLLM 0.32, 0.33).
Why: on SM120/121 the cuBLAS batched BF16 GEMM reads past the strided operand of
``torch.bmm(x.transpose(0, 1), W_UV, out=...)`` and faults (Xid 31), seen after long
chunked prefill.
How: for the generic path (not AMX or aiter), when the GPU is SM12x, the backend's
capability sets ``needs_safe_query_bmm`` or ``VLLM_MLA_SAFE_BMM=always`` (``never``
turns it off), the same product runs through
``safe_mla_query_bmm`` (our bounds-checked kernel, or a contiguous copy where it is
not built), or, when W_UV is upstream's transposed view of a kept BF16 kv_b_proj,
through torch.bmm on a contiguous copy of the activation (the known workaround);
everywhere else the original runs untouched. The decision is made once per layer.
A layer whose W_UV is routed (``AbsorbedWeight``: safe mode bound by the post-load
patch, or direct mode) runs the original, whose bmm already goes through our op; this
patch covers layers without the route (the ``lifecycle`` feature off).
Removal: when cuBLAS or upstream's _v_up_proj is safe on SM12x.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vllm_mla.ops import safe_mla_query_bmm
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.vllm import telemetry
from vllm_mla.vllm.patches.mla_post_load import needs_safe_bmm

DECISION_ATTR = "_vllm_mla_safe_v_up"


def make_v_up_proj(original: Callable) -> Callable:
    """The replacement for ``MLAAttention._v_up_proj``."""

    def _v_up_proj(self: nn.Module, x: torch.Tensor, out: torch.Tensor):
        safe = self.__dict__.get(DECISION_ATTR)
        if safe is None:
            safe = self.__dict__[DECISION_ATTR] = needs_safe_bmm(self, x.device)
        if isinstance(self.W_UV, AbsorbedWeight):
            # safe or direct route bound: upstream's own bmm runs our op
            telemetry.record_query("v_up_proj:routed")
            return original(self, x, out)
        if not safe:
            telemetry.record_query("v_up_proj:original")
            return original(self, x, out)
        x = x.view(-1, self.num_heads, self.kv_lora_rank).transpose(0, 1)
        out = out.view(-1, self.num_heads, self.v_head_dim).transpose(0, 1)
        if self.W_UV.stride(-1) == 1 and x.dtype == torch.bfloat16:
            telemetry.record_query("v_up_proj:safe_bmm")
            safe_mla_query_bmm(x, self.W_UV, out)
        else:
            # Upstream's transposed view of a kept dense kv_b_proj (or a dtype the safe op
            # does not take) cannot feed the safe op; the known-safe workaround copies the
            # strided activation instead.
            telemetry.record_query("v_up_proj:contiguous_copy")
            torch.bmm(x.contiguous(), self.W_UV, out=out)
        return None

    return _v_up_proj
