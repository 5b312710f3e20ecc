"""The query projection's reference: the staged path vLLM runs (bmm -> cat -> quant)."""

from __future__ import annotations

import torch

from vllm_mla.formats import E4M3_MAX
from vllm_mla.ops.base import MXFP8Weight
from vllm_mla.ops.query_projection.api import Args, Weight, validate
from vllm_mla.quant import mxfp8


def bf16_weight(weight: torch.Tensor | MXFP8Weight) -> torch.Tensor:
    if isinstance(weight, MXFP8Weight):
        return mxfp8.dequantize(mxfp8.MXFP8Tensor(weight.values, weight.scales, 2), torch.bfloat16)
    return weight


def staged(args: Args, q_nope, q_pe, out, q_scale) -> torch.Tensor:
    """bmm (bf16 result) -> cat q_pe -> optional FP8 quant into ``out``, on validated ``args``."""
    latent = torch.bmm(q_nope.transpose(0, 1), bf16_weight(args.weight)).transpose(0, 1)
    full = torch.cat([latent, q_pe], dim=-1)
    if args.fp8_out:
        full = (full.float() / q_scale.reshape(())).clamp(-E4M3_MAX, E4M3_MAX)
    out.copy_(full)
    return out


def staged_query_projection(
    q_nope: torch.Tensor,
    weight: Weight,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    *,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: bmm (bf16 result) -> cat q_pe -> optional FP8 quant, written into out."""
    return staged(validate(q_nope, weight, q_pe, out, q_scale), q_nope, q_pe, out, q_scale)
