"""DeepSeek-V4's sparse attention over its two sources with the sink, in torch (fp32).

Every query row attends to the KV rows at its sliding-window slots and at its compressed
slots (C4: the indexer's top-k; C128: every entry so far), both read from 584-byte records
(``record``), in one softmax that also holds the head's sink logit, which takes weight but
adds no value: ``out = sum_j softmax([s_j..., sink])_j v_j`` with ``s_j = scale * q . k_j``
and ``v_j = k_j`` (one latent, 512 wide). A negative slot is no token; a row with none
attends to the sink alone and gives zeros. This is the contract of vLLM CPU's
``flash_mla_with_kvcache_cpu`` (``tests_vllm`` compares the two).
"""

from __future__ import annotations

import torch

from vllm_mla.formats import DSV4_HEAD
from vllm_mla.ops.dsv4 import record

# fp32 key values gathered at once (128 MiB): queries run in chunks of tokens under it. A
# prefill gathers every token's window and top-k: 4,350 tokens x 544 rows x 512 at once
# were 4.8 GB per rank (a TP 2 engine killed for memory).
MAX_GATHERED = 1 << 25


def attend(
    q: torch.Tensor,
    window_cache: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache: torch.Tensor | None,
    compressed_slots: torch.Tensor | None,
    compressed_block_size: int,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[T, H, 512]`` fp32 outputs for queries ``q`` (``[T, H, 512]``): ``window_slots``
    ``[T, W]`` and ``compressed_slots`` ``[T, C]`` (or None) index the two paged caches;
    ``sink`` ``[H]`` holds each head's sink logit (``-inf``: no sink)."""
    if q.shape[-1] != DSV4_HEAD or q.dim() != 3:
        raise ValueError(f"queries must be [T, H, {DSV4_HEAD}], got {tuple(q.shape)}")
    width = window_slots.shape[1] + (0 if compressed_slots is None else compressed_slots.shape[1])
    step = max(1, MAX_GATHERED // (max(width, 1) * DSV4_HEAD))
    if q.shape[0] > step:
        return torch.cat([
            attend(
                q[i : i + step], window_cache, window_slots[i : i + step], window_block_size,
                compressed_cache,
                None if compressed_slots is None else compressed_slots[i : i + step],
                compressed_block_size, sink, scale,
            )
            for i in range(0, q.shape[0], step)
        ])  # fmt: skip
    slots = [(window_cache, window_slots, window_block_size)]
    if compressed_slots is not None and compressed_slots.numel():
        slots.append((compressed_cache, compressed_slots, compressed_block_size))
    keys = torch.cat([record.read(c, s, b) for c, s, b in slots], dim=1)  # [T, N, 512]
    valid = torch.cat([s >= 0 for _, s, _ in slots], dim=1)  # [T, N]
    scores = torch.einsum("thd,tnd->thn", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sinks = sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    weights = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
    weights = torch.nan_to_num(weights)  # no token and no sink: all -inf, no weight
    return torch.einsum("thn,tnd->thd", weights, keys)
