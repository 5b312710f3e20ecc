"""DeepSeek-V4's RoPE: GPT-J (interleaved pairs) rotation of each row's last 64 values.

``cos_sin`` is vLLM's table, one fp32 row per position: 32 cosines, then 32 sines. Pair
``i`` of a row (values ``2i``, ``2i + 1`` of its last 64) turns by position's angle ``i``
(``inverse``: back by it, what V4 applies to the attention output). fp32 throughout.
"""

from __future__ import annotations

import torch

from vllm_mla.formats import ROPE


def rotate(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """``x`` (``[T, ..., D]``, D >= 64) as fp32 with its last 64 values turned by each
    token's position (``positions`` ``[T]``)."""
    out = x.float().clone()
    half = ROPE // 2
    table = cos_sin[positions.long()].float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = table[:, :half].view(shape), table[:, half:].view(shape)
    if inverse:
        sin = -sin
    even, odd = out[..., -ROPE::2].clone(), out[..., -ROPE + 1 :: 2].clone()
    out[..., -ROPE::2] = even * cos - odd * sin
    out[..., -ROPE + 1 :: 2] = even * sin + odd * cos
    return out
