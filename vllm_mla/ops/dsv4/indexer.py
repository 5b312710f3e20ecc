"""DeepSeek-V4's indexer queries in torch: rotated, then e4m3 per token and head.

Each head's query turns by the token's position (RoPE on its last 64 values, fp32), then
is stored as e4m3 over a power-of-two scale, ``2**ceil(log2(max(amax, 1e-4) / 448))``
(the amax floored, as vLLM's writers of query scales do); the scale folds into the head's
weight, with the softmax scale and the head scale, so the logits need no other factor.
This is the contract of vLLM CPU's ``fused_indexer_q_rope_quant_cpu``.
"""

from __future__ import annotations

import torch

from vllm_mla.formats import DSV4_FLOOR, E4M3_MAX
from vllm_mla.ops.dsv4 import rope


def quantize_queries(
    q: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    weights: torch.Tensor,
    softmax_scale: float,
    head_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 queries ``[T, H, 128]``, fp32 weights ``[T, H]`` with each scale folded in)."""
    rotated = rope.rotate(q, positions, cos_sin)
    amax = rotated.abs().amax(-1).clamp_min(DSV4_FLOOR)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    values = (rotated / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    return values.to(torch.float8_e4m3fn), weights.float() * scale * softmax_scale * head_scale
