"""The Triton kernels of the DSA lightning indexer (CUDA SM80+) and their launches.

Launched on validated arguments only (``custom_op``); the contract is ``api``'s. On CPU
the kernels run only under ``TRITON_INTERPRET=1``; there ``INTERPRET`` makes the dots
fp32 (the interpreter's bf16 dot is wrong: it rounds unlike a GPU's). GPU code never
takes those branches. ``topk_into`` is plain torch (batched, no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mla import envs
from vllm_mla.ops.sparse_indexer.reference import AMAX_FLOOR, E4M3_MAX
from vllm_mla.ops.triton_bits import e4m3_to_f32, f32_to_e4m3

# |paged_logits - reference.logits| <= LOGIT_RTOL * k_scale * sum_h |w_h| sum_d |q_hd k_d|
# + LOGIT_ATOL. Operands are exact (e4m3 and bf16 values are bf16 values, their products
# exact in fp32), so only the order of the fp32 sums differs: each side rounds <= ~192
# partial sums (128 in the dot, up to 64 heads) by <= 2**-24 of that magnitude, ~2.3e-5
# for the difference with round-to-nearest, ~4.6e-5 if the tensor cores truncate; 1e-4
# leaves 2x over that. LOGIT_ATOL covers fp32 subnormal products flushed to zero on GPUs.
LOGIT_RTOL = 1e-4
LOGIT_ATOL = 1e-30

BLOCK_N = 64  # keys per logits program: one 64-row page of vLLM's index cache
# Heads per dot; more loop over the same decoded keys (DeepSeek-V3.2 has 64, GLM-5 32).
# ptxas (Triton 3.9, 4 warps, sm80/89/90/120): 32 heads take 77-112 registers, 64 heads
# 128-195 for no less memory traffic (q is read once per program either way); shared
# memory 18-24 KiB, no spills. tests/test_sparse_indexer_triton.py compiles both tiles.
MAX_BLOCK_H = 32
INSERT_BLOCK_T = 8  # tokens per insert program
NUM_WARPS = 4
_FLOOR = tl.constexpr(AMAX_FLOOR)  # 1e-4
_E4M3_MAX = tl.constexpr(E4M3_MAX)  # 448.0
_INT64_MIN = -(2**63)


@triton.jit
def _ue8m0(scale):
    """``exp2(ceil(log2(scale)))`` as the reference computes it in fp32, on the bits.

    The reference's fp32 log2 of ``2**e * (1 + f * 2**-23)`` rounds to exactly ``e`` when
    ``log2(1 + f * 2**-23)`` is under half the fp32 spacing at ``e`` (a few ulps above a
    power of two), and then keeps ``2**e``; elsewhere the result is the true ceiling. The
    half spacing is ``2**(bitlen(n) - 25)`` with ``n = e`` (e > 0) or ``-e - 1`` (e < 0,
    where ``e + log2(m)`` lies just inside ``|e|``), so the condition is ``f (1 - f 2**-24)
    < ln2 / 2 * 2**(bitlen(n) - 1)``, never within 8% of equality for |e| < 32.
    """
    bits = scale.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    f = (bits & 0x7FFFFF).to(tl.float32)
    n = tl.where(e < 0, -e - 1, e).to(tl.float32)
    top = (n.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # 2**floor
    rounds_down = f * (1.0 - f * 5.960464477539063e-08) < top * 0.34657359027997264  # ln2 / 2
    up = (f > 0) & ~((n >= 1.0) & rounds_down)
    return ((e + 127 + up.to(tl.int32)) << 23).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["T"])
def _insert_keys_kernel(
    k_ptr,
    slot_ptr,
    cache_ptr,
    T,
    num_rows,
    block_size,
    s_kt,
    s_kd,
    s_page,
    UE8M0: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + tok, mask=tok < T, other=-1).to(tl.int64)
    ok = (slot >= 0) & (slot < num_rows)  # past the pool: skipped, never a stray write
    slot = tl.where(ok, slot, 0)
    d = tl.arange(0, 128)
    x = tl.load(
        k_ptr + tok.to(tl.int64)[:, None] * s_kt + d[None, :] * s_kd, mask=ok[:, None], other=0.0
    ).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    # div_rn: Triton's plain fp32 `/` is approximate on the GPU; the reference's is IEEE.
    scale = tl.math.div_rn(tl.maximum(amax, _FLOOR), _E4M3_MAX)
    if UE8M0:
        scale = _ue8m0(scale)
    code = f32_to_e4m3(tl.math.div_rn(x, scale[:, None]))
    page = slot // block_size
    off = slot % block_size
    base = cache_ptr + page * s_page
    tl.store(base[:, None] + off[:, None] * 128 + d[None, :], code, mask=ok[:, None])
    scale_ptr = (base + block_size * 128 + off * 4).to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr, scale, mask=ok)


@triton.jit(do_not_specialize=["S", "s_ot", "bt_width", "s_bt"])
def _paged_logits_kernel(
    q_ptr,  # [T, H, 128] bf16, or the uint8 bits of float8_e4m3fn (Q_FP8)
    w_ptr,  # [T, H] fp32
    cache_ptr,  # uint8 pages (reference module docstring), page p at p * s_page
    bt_ptr,  # int32 [T, bt_width]: the block-table row of each token's request
    len_ptr,  # int32 [T]: causal context length
    out_ptr,  # fp32 [T, S]
    H,
    S,
    bt_width,
    num_blocks,
    block_size,
    s_qt,
    s_qh,
    s_wt,
    s_bt,
    s_page,
    s_ot,
    Q_FP8: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    pos = n0 + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + t * s_ot + pos
    # Positions past the block table are never read (masked to -inf like those past L).
    length = tl.minimum(tl.load(len_ptr + t), bt_width * block_size)
    if n0 < length:
        valid = pos < length
        page = tl.load(bt_ptr + t * s_bt + pos // block_size, mask=valid, other=0)
        # A table entry outside the pool: -inf, never a stray read.
        valid = valid & (page >= 0) & (page < num_blocks)
        base = cache_ptr + tl.where(valid, page, 0).to(tl.int64) * s_page
        off = pos % block_size
        d = tl.arange(0, 128)
        k = e4m3_to_f32(
            tl.load(base[:, None] + off[:, None] * 128 + d[None, :], mask=valid[:, None], other=0)
        )
        if not INTERPRET:
            k = k.to(tl.bfloat16)  # exact: e4m3 values are bf16 values
        scale_ptr = (base + block_size * 128 + off * 4).to(tl.pointer_type(tl.float32))
        k_scale = tl.load(scale_ptr, mask=valid, other=0.0)
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for h0 in range(0, H, BLOCK_H):
            heads = h0 + tl.arange(0, BLOCK_H)
            hmask = heads < H
            q = tl.load(
                q_ptr + t * s_qt + heads[:, None] * s_qh + d[None, :], mask=hmask[:, None], other=0
            )
            if Q_FP8:
                q = e4m3_to_f32(q)
            if INTERPRET:
                s = tl.dot(q.to(tl.float32), tl.trans(k))
            else:
                s = tl.dot(q.to(tl.bfloat16), tl.trans(k))  # fp32 accumulation
            w = tl.load(w_ptr + t * s_wt + heads, mask=hmask, other=0.0)
            acc += tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        tl.store(out_ptrs, tl.where(valid, acc * k_scale, float("-inf")), mask=pos < S)
    else:
        tl.store(out_ptrs, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=pos < S)


def _block_h(num_heads: int) -> int:
    """Heads per dot: tl.dot needs >= 16 rows; more than MAX_BLOCK_H loop."""
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(num_heads)))


def launch_insert_keys(cache, k, slots, ue8m0: bool) -> None:
    """Write ``k``'s quantized rows at ``slots`` (validated; T > 0)."""
    t = slots.shape[0]
    nb, bs, _ = cache.shape
    _insert_keys_kernel[(triton.cdiv(t, INSERT_BLOCK_T),)](
        k,
        slots,
        cache,
        t,
        nb * bs,
        bs,
        k.stride(0),
        k.stride(1),
        cache.stride(0),
        UE8M0=ue8m0,
        BLOCK_T=INSERT_BLOCK_T,
        num_warps=NUM_WARPS,
    )


def launch_paged_logits(q, weights, cache, block_tables, lengths, out) -> None:
    """Fill ``out [T, S]`` (validated; T, S > 0)."""
    t, h, _ = q.shape
    s = out.shape[-1]
    interpret = envs.triton_interpret()
    q_arg = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
    _paged_logits_kernel[(t, triton.cdiv(s, BLOCK_N))](
        q_arg,
        weights,
        cache,
        block_tables,
        lengths,
        out,
        h,
        s,
        block_tables.shape[1],
        cache.shape[0],
        cache.shape[1],
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        block_tables.stride(0),
        cache.stride(0),
        out.stride(0),
        Q_FP8=q.dtype == torch.float8_e4m3fn,
        BLOCK_H=_block_h(h),
        BLOCK_N=BLOCK_N,
        INTERPRET=interpret,
        num_warps=NUM_WARPS,
        num_stages=1,  # nothing to pipeline: one page of keys, at most a few head chunks
    )


def topk_into(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
    """``select_topk``'s result into validated ``out`` (plain torch, no host sync)."""
    t, s = scores.shape
    out.fill_(-1)
    width = min(out.shape[1], s)
    if t == 0 or width == 0:
        return
    x = scores.float() + 0.0  # -0.0 -> +0.0: the reference ties them
    x = x.masked_fill(x.isnan(), float("nan"))  # one NaN: sort ranks every NaN first
    bits = x.view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64) << 32
    key += torch.arange(s - 1, -1, -1, device=scores.device)  # lower position wins a tie
    positions = torch.arange(s, device=scores.device)
    lengths = lengths.to(torch.int64)
    key.masked_fill_(positions[None, :] >= lengths[:, None], _INT64_MIN)
    picked = torch.topk(key, width, dim=1).indices  # keys are distinct: deterministic
    taken = positions[None, :width] < lengths[:, None]
    out[:, :width] = torch.where(taken, picked, -1).to(torch.int32)
