"""DeepSeek-V4's compressors in torch: partial states in, compressed cache entries out.

Every token saves its compressor state row, ``[kv | score + ape[pos % ratio]]`` (each
``coff * D`` wide: C4's rows hold two halves, the window's and the next one's), at its
state slot. A token that ends a window (``(pos + 1) % ratio == 0``) compresses the last
``coff * ratio`` tokens' rows: per channel a softmax of the scores over the tokens, the
previous window's tokens read from the first half of their rows and the current window's
from the second (C128: one half), weighting their values; then RMSNorm with the
compressor's weight, and RoPE at the window's first position on the last 64 channels.
Main compressors (D = 512) store the entry as a 584-byte record (``record``); indexer
compressors (D = 128) as a 128-byte e4m3 key with one power-of-two fp32 scale, pages of
key rows then scale words (``store_index_keys``). This is the contract of vLLM CPU's
``save_partial_states_cpu`` / ``compress_norm_rope_store_cpu`` /
``compress_norm_rope_store_indexer_cpu``.
"""

from __future__ import annotations

import torch

from vllm_mla.formats import INDEX_HEAD_DIM
from vllm_mla.ops.dsv4 import record, rope


def save_states(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    state_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Each token's ``[kv | score + ape[pos % ratio]]`` at its state slot (skip < 0) of
    ``state_cache`` ``[blocks, block_size, 2 * coff * D]`` (its pages may be strided)."""
    keep = slots >= 0
    pos, slot = positions[keep].long(), slots[keep].long()
    bias = ape.float()[pos % ape.shape[0]]
    block = state_cache.shape[1]
    rows = torch.cat([kv[keep].float(), score[keep].float() + bias], -1)
    state_cache[slot // block, slot % block] = rows.to(state_cache.dtype)


def compress(
    state_cache: torch.Tensor, gather_slots: torch.Tensor, ratio: int, width: int
) -> torch.Tensor:
    """``[T, width]`` fp32 entries from each token's window (``gather_slots`` ``[T, W]``,
    the state slots of its last ``W`` tokens, -1 before the sequence)."""
    window = gather_slots.shape[-1]
    valid = gather_slots >= 0
    slot, block = gather_slots.clamp_min(0).long(), state_cache.shape[1]
    taken = state_cache[slot // block, slot % block].float()  # [T, W, 2 * coff * width]
    state = taken.shape[-1] // 2
    half = (torch.arange(window, device=taken.device) >= ratio).long() * width
    channel = half[:, None] + torch.arange(width, device=taken.device)  # [W, width]
    kv = taken[..., :state].gather(-1, channel.expand(taken.shape[0], -1, -1))
    score = taken[..., state:].gather(-1, channel.expand(taken.shape[0], -1, -1))
    score = score.masked_fill(~valid[..., None], float("-inf"))
    return (torch.softmax(score, dim=1) * kv.masked_fill(~valid[..., None], 0.0)).sum(1)


def entries(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    ratio: int,
) -> torch.Tensor:
    """``[T, D]`` fp32 rows ready to store, one per window-ending token: its window
    compressed (``compress``), RMSNorm with ``weight`` (``[D]``), RoPE at the window's
    first position."""
    rows = compress(state_cache, gather_slots, ratio, weight.numel())
    normed = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return rope.rotate(normed, positions.long() // ratio * ratio, cos_sin)


def _boundaries(positions: torch.Tensor, kv_slots: torch.Tensor, ratio: int) -> torch.Tensor:
    return ((positions + 1) % ratio == 0) & (kv_slots >= 0)


def store_entries(
    state_cache, gather_slots, positions, kv_slots, weight, eps, cos_sin, cache, block, ratio
) -> None:
    """The main compressor's entries (D = 512) as records at ``kv_slots``, for the tokens
    that end a window."""
    done = _boundaries(positions, kv_slots, ratio)
    if not done.any():
        return
    rows = entries(state_cache, gather_slots[done], positions[done], weight, eps, cos_sin, ratio)
    record.write(cache, rows, kv_slots[done], block)


def index_key_bytes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 128]`` keys to (e4m3 bytes ``[T, 128]``, fp32 scales ``[T]``): the bf16-rounded
    row over its power-of-two scale, ``2**ceil(log2(amax / 448))`` with ``amax / 448``
    floored at 1e-4, values under e4m3's smallest normal stored as zeros of their sign
    (vLLM CPU's writer)."""
    values, exponent = record.scaled(rows.to(torch.bfloat16).float(), "cpu")
    return values.to(torch.float8_e4m3fn).view(torch.uint8), torch.exp2(exponent)


def store_index_keys(
    state_cache, gather_slots, positions, kv_slots, weight, eps, cos_sin, cache, block, ratio
) -> None:
    """The indexer compressor's keys (D = 128) at ``kv_slots``: pages of ``block`` key rows
    then ``block`` fp32 scales."""
    done = _boundaries(positions, kv_slots, ratio)
    if not done.any():
        return
    if weight.numel() != INDEX_HEAD_DIM:
        raise ValueError(f"an indexer key is {INDEX_HEAD_DIM} wide, got a norm of {weight.numel()}")
    keys = entries(state_cache, gather_slots[done], positions[done], weight, eps, cos_sin, ratio)
    values, scales = index_key_bytes(keys)
    pages = cache.view(cache.shape[0], -1)
    slot = kv_slots[done].long()
    page, row = slot // block, slot % block
    data = pages[:, : block * INDEX_HEAD_DIM].view(-1, block, INDEX_HEAD_DIM)
    data[page, row] = values
    words = pages[:, block * INDEX_HEAD_DIM : block * (INDEX_HEAD_DIM + 4)]
    words.view(torch.float32).view(-1, block)[page, row] = scales
