"""The nvfp4_ds_mla cache writer in Triton: one program per token, no FP4/FP8 PTX.

Every step is the rule of ``nvfp4_record`` done on the bits or in exactly rounded fp32,
so the bytes equal its torch encoder's on any GPU from SM80 (and in the interpreter):
the block amax is a max (exact), ``amax / 6`` and ``x / sf`` are true divisions
(``div_rn``: a reciprocal-multiply can land beside a tie the division hits), the scale
and RoPE are rounded to e4m3 on the bits (``f32_to_e4m3``, saturating) and the latent
to e2m1 by integer rounding per binade (``f32_to_e2m1``, ties to the even code).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mla.ops.sparse_mla import nvfp4_record
from vllm_mla.ops.triton_bits import e4m3_to_f32, f32_to_e2m1, f32_to_e4m3

_ROPE_AT = tl.constexpr(nvfp4_record.ROPE_OFFSET)
_SCALES_AT = tl.constexpr(nvfp4_record.SCALES_OFFSET)
_E2M1_MAX = tl.constexpr(nvfp4_record.E2M1_MAX)
_FLOOR = tl.constexpr(nvfp4_record.SCALE_FLOOR)


@triton.jit
def _nvfp4_write_kernel(
    kvc_ptr,
    kpe_ptr,
    cache_ptr,
    slot_ptr,
    s_kvc,
    s_kpe,
    s_cb,
    s_ct,
    block_size,
    ROPE: tl.constexpr,  # k_pe width: 64, or 0 (the RoPE slot written as zeros)
    BLOCKS: tl.constexpr,  # 32 scale blocks of 16 latent values
):
    t = tl.program_id(0)
    raw = tl.load(slot_ptr + t).to(tl.int64)
    slot = tl.maximum(raw, 0)  # a slot < 0 (padded / skipped token) writes nothing
    dst = cache_ptr + (slot // block_size) * s_cb + (slot % block_size) * s_ct
    blk = tl.arange(0, BLOCKS)
    pair = tl.arange(0, 8)  # the 8 bytes of a block: elements (2p, 2p + 1)
    src = kvc_ptr + t.to(tl.int64) * s_kvc + blk[:, None] * 16 + 2 * pair[None, :]
    even = tl.load(src).to(tl.float32)
    odd = tl.load(src + 1).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(even), axis=1), tl.max(tl.abs(odd), axis=1))
    sf_code = f32_to_e4m3(tl.maximum(tl.math.div_rn(amax, _E2M1_MAX), _FLOOR))
    sf = e4m3_to_f32(sf_code)[:, None]
    lo = f32_to_e2m1(tl.math.div_rn(even, sf))
    hi = f32_to_e2m1(tl.math.div_rn(odd, sf))
    ok_blk = (blk + raw) >= blk  # masks as tensors (the interpreter takes no scalar mask)
    codes = (lo | (hi << 4)).to(tl.uint8)
    tl.store(
        dst + blk[:, None] * 8 + pair[None, :], codes, mask=ok_blk[:, None] & (pair >= 0)[None, :]
    )
    tl.store(dst + _SCALES_AT + 8 * (blk & 3) + (blk >> 2), sf_code, mask=ok_blk)
    r = tl.arange(0, 64)
    ok_r = (r + raw) >= r
    if ROPE > 0:
        pe = tl.load(kpe_ptr + t.to(tl.int64) * s_kpe + r).to(tl.float32)
        tl.store(dst + _ROPE_AT + r, f32_to_e4m3(pe), mask=ok_r)
    else:
        tl.store(dst + _ROPE_AT + r, tl.zeros((64,), tl.uint8), mask=ok_r)


def launch_nvfp4_write(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``slot_mapping.shape[0]`` tokens' records (validated ``write_records``
    arguments: ``kv_c [>=T, 512]``, ``k_pe [>=T, rope]``, last dims contiguous)."""
    tokens = slot_mapping.shape[0]
    if tokens == 0:
        return
    rope = k_pe.shape[-1]
    _nvfp4_write_kernel[(tokens,)](
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        kv_c.stride(0),
        k_pe.stride(0) if rope else 0,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.shape[1],
        ROPE=rope,
        BLOCKS=nvfp4_record.BLOCKS,
        num_warps=1,
    )
