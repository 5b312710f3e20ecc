"""The absorbed BMM's contract in plain torch (the reference every path is checked against),
and the chunked CPU path for MXFP8 weights."""

from __future__ import annotations

import torch

from vllm_mla.ops.absorbed_matmul.api import Weight, as_uint8, scales_along_k
from vllm_mla.ops.base import MXFP8Weight
from vllm_mla.quant import mxfp8

DECODE_SCRATCH_BYTES = 8 << 20  # bound on the torch path's decoded weight chunk


def decode(weight: MXFP8Weight, dtype: torch.dtype, heads: slice = slice(None)) -> torch.Tensor:
    """The dense ``[B, K, N]`` values of ``weight[heads]`` in ``dtype`` (exact for bf16/fp32)."""
    values, scales = weight.values[heads], as_uint8(weight.scales[heads])
    axis = 1 if scales_along_k(values, scales) else 2
    code = mxfp8.decode_scales(scales).repeat_interleave(mxfp8.BLOCK_SIZE, dim=axis)
    return (values.to(torch.float32) * code).to(dtype)


def absorbed_bmm_reference(a: torch.Tensor, weight: Weight) -> torch.Tensor:
    """The contract in plain torch: fp32 products and sums, rounded once to ``a``'s dtype."""
    w = decode(weight, torch.float32) if isinstance(weight, MXFP8Weight) else weight.float()
    return torch.bmm(a.float(), w).to(a.dtype)


def torch_mxfp8(
    a: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
) -> None:
    """``out = a @ W`` for an MXFP8 weight on any CPU: a few heads decoded at a time."""
    weight = MXFP8Weight(values, scales)
    # fp32 products and sums, one rounding into out: the contract, on any CPU
    batch, _, k = a.shape
    per_head = k * weight.values.shape[2] * 4
    step = max(1, DECODE_SCRATCH_BYTES // max(per_head, 1))
    for h in range(0, batch, step):
        heads = slice(h, min(h + step, batch))
        w = decode(weight, torch.float32, heads)
        out[heads].copy_(torch.bmm(a[heads].float(), w))
