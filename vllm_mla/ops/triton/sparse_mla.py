"""Triton sparse MLA (absorbed / MQA form), split-K over the top-k indices, SM80+.

Kernel 1, ``_sparse_mla_split_kernel``, grid ``(T, cdiv(H, BLOCK_H), num_splits)``:
one program takes one token, ``BLOCK_H`` heads (masked past H) and one contiguous
slice of ``split_len`` indices, walked in chunks of ``BLOCK_K`` gathered rows. Per
chunk: scores = q_pe @ k_pe^T + sum over four 128-wide latent pieces of
q_piece @ kv_piece^T (fp8: the e4m3 piece is decoded exactly to bf16 on the bits and
its group scale applied to the [BLOCK_H, BLOCK_K] partial score); online softmax in
base 2; acc_piece += p @ kv_piece (fp8: p * scale in bf16), fp32 accumulation. With
one split it writes ``out`` and ``lse`` itself; otherwise it writes unnormalised
partials (acc [512], m, l) that kernel 2, ``_sparse_mla_combine_kernel`` (grid
``(T, H)``), merges into out + lse.

Tiles (GPU): BLOCK_H = 16 (tl.dot needs >= 16 rows), BLOCK_K = 32, 8 warps.
Shared memory per program, estimate: q 16x576 bf16 (18 KiB, hoisted out of the loop
by the compiler) + per stage a gathered chunk 32x576 bf16 (36 KiB; fp8 stages its
scales and k_pe, decoding the latent in registers) -> ~55 KiB at 1 stage. ptxas
(Triton 3.9, this file, 8 warps): 56-59 KiB shared on sm80/90/100/120 at
``num_stages`` 2 (22.5 KiB for fp8 at 1 stage), 98-148 registers/thread, no spills;
under the 99 KiB SM12x limit. ``num_stages`` is 1 on SM12x (two fp8 programs per SM
there), 2 elsewhere. tests/test_sparse_mla.py compiles these for real GPU targets.

Split count (shapes only, so CUDA graphs and ``scratch_bytes`` agree): enough
splits for ``TARGET_PROGRAMS`` programs (T=32, H=16, K=2048: 8 splits x 256 rows,
256 programs for 132 SMs), at most ``MAX_SPLITS``, whole chunks per split.

``INTERPRET`` (Triton's CPU interpreter only, whose bf16 dot and fp32->bf16 cast are
wrong, REFERENCE.md section 2) makes every dot fp32 and rounds the bf16 output on the
bits. GPU code never takes those branches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_mla import envs
from vllm_mla.ops.sparse_mla.kv_format import SparseMLANotPrepared
from vllm_mla.ops.triton.query_projection import _round_to_bf16

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _e4m3_to_f32(bits):
    """float8_e4m3fn codes (uint8) -> fp32, exact, on the bits (no fp8 type: SM80 too)."""
    b = bits.to(tl.int32)
    mag = b & 0x7F
    # Normal: exponent e (bias 7) -> e + 120 (bias 127), mantissa shifted up 20 bits.
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    sub = (mag & 7).to(tl.float32) * 0.001953125  # subnormal: m * 2**-9
    val = tl.where(mag >= 8, normal, sub)
    val = tl.where(mag == 0x7F, float("nan"), val)
    return tl.where((b & 0x80) != 0, -val, val)


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def _latent_piece(kv_ptr, base, valid, PIECE: tl.constexpr, FP8: tl.constexpr, PV: tl.constexpr):
    """[BLOCK_K, 128] latent piece of the gathered rows (fp8: decoded, unscaled) and,
    for fp8, its [BLOCK_K] group scale."""
    cols = PIECE * 128 + tl.arange(0, 128)
    ptrs = kv_ptr + base[:, None] + cols[None, :]
    if FP8 and PV:
        # A load distinct from the QK one (last use of the line), so the compiler cannot
        # merge the two and keep four decoded pieces live in registers across the softmax
        # (it did: 255 registers + spills on sm90/sm120); the reload hits L1.
        x = tl.load(ptrs, mask=valid[:, None], other=0, eviction_policy="evict_first")
    else:
        x = tl.load(ptrs, mask=valid[:, None], other=0)
    scale = 1.0
    if FP8:
        scale_ptr = (kv_ptr + base + 512 + 4 * PIECE).to(tl.pointer_type(tl.float32))
        scale = tl.load(scale_ptr, mask=valid, other=0.0)
        x = _e4m3_to_f32(x).to(tl.bfloat16)  # exact: e4m3 values are bf16 values
    return x, scale


@triton.jit
def _qk_piece(
    q_rows, hmask, kv_ptr, base, valid, PIECE: tl.constexpr, FP8: tl.constexpr, INTERPRET
):
    # q is reloaded per chunk (an L1 hit): held across the loop, 16x576 bf16 replicated in
    # every warp's MMA operand registers costs ~144 registers per thread and spills.
    q = tl.load(q_rows + PIECE * 128, mask=hmask[:, None], other=0.0)
    kv, scale = _latent_piece(kv_ptr, base, valid, PIECE, FP8, False)
    s = _dot(q, tl.trans(kv), INTERPRET)
    if FP8:
        s = s * scale[None, :]
    return s


@triton.jit
def _pv_piece(acc, alpha, p, kv_ptr, base, valid, PIECE: tl.constexpr, FP8, INTERPRET):
    kv, scale = _latent_piece(kv_ptr, base, valid, PIECE, FP8, True)
    if FP8:
        p = p * scale[None, :]
    return acc * alpha[:, None] + _dot(p, kv, INTERPRET)


@triton.jit
def _store_out(ptr, rows, cols, mask, val, INTERPRET: tl.constexpr):
    if INTERPRET and ptr.dtype.element_ty == tl.bfloat16:
        out = _round_to_bf16(val)
    else:
        out = val.to(ptr.dtype.element_ty)
    tl.store(ptr + rows[:, None] + cols[None, :], out, mask=mask[:, None])


@triton.jit
def _store_acc(ptr, rows, mask, acc0, acc1, acc2, acc3, inv_l, INTERPRET: tl.constexpr):
    cols = tl.arange(0, 128)
    _store_out(ptr, rows, cols, mask, acc0 * inv_l[:, None], INTERPRET)
    _store_out(ptr, rows, cols + 128, mask, acc1 * inv_l[:, None], INTERPRET)
    _store_out(ptr, rows, cols + 256, mask, acc2 * inv_l[:, None], INTERPRET)
    _store_out(ptr, rows, cols + 384, mask, acc3 * inv_l[:, None], INTERPRET)


@triton.jit(do_not_specialize=["T", "K", "split_len", "s_idx"])
def _sparse_mla_split_kernel(
    qn_ptr,
    qp_ptr,
    kv_ptr,
    idx_ptr,
    len_ptr,
    out_ptr,  # DIRECT: out [T, H, 512]; else partial acc [T, H, S, 512] fp32
    lse_ptr,  # DIRECT: lse [T, H]; else partial m [T, H, S] fp32 (base-2 units)
    l_ptr,  # partial l [T, H, S] fp32 (unused when DIRECT)
    T,
    H,
    K,
    split_len,
    block_size,
    qk_scale,  # softmax_scale * log2(e)
    s_qn_t,
    s_qn_h,
    s_qp_t,
    s_qp_h,
    s_kv_b,
    s_kv_t,
    s_idx,
    s_o_t,
    s_o_h,
    s_lse_t,
    FP8: tl.constexpr,
    HAS_LENGTHS: tl.constexpr,
    DIRECT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    t64 = t.to(tl.int64)

    d = tl.arange(0, 128)
    q_rows = qn_ptr + t64 * s_qn_t + heads[:, None] * s_qn_h + d[None, :]
    r = tl.arange(0, 64)
    qpe_ptrs = qp_ptr + t64 * s_qp_t + heads[:, None] * s_qp_h + r[None, :]

    end = K
    if HAS_LENGTHS:
        end = tl.minimum(tl.load(len_ptr + t), K)
    start = split * split_len
    end = tl.minimum(end, start + split_len)

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, 128), tl.float32)
    acc1 = tl.zeros((BLOCK_H, 128), tl.float32)
    acc2 = tl.zeros((BLOCK_H, 128), tl.float32)
    acc3 = tl.zeros((BLOCK_H, 128), tl.float32)
    for k0 in range(start, end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        rows = tl.load(idx_ptr + t64 * s_idx + ks, mask=ks < end, other=-1)
        valid = rows >= 0
        rows = tl.where(valid, rows, 0)
        base = (rows // block_size).to(tl.int64) * s_kv_b + (rows % block_size) * s_kv_t
        if FP8:
            pe_ptrs = (kv_ptr + base[:, None] + 528).to(tl.pointer_type(tl.bfloat16))
        else:
            pe_ptrs = kv_ptr + base[:, None] + 512
        kpe = tl.load(pe_ptrs + r[None, :], mask=valid[:, None], other=0.0)
        qpe = tl.load(qpe_ptrs, mask=hmask[:, None], other=0.0)
        s = _dot(qpe, tl.trans(kpe), INTERPRET)
        s += _qk_piece(q_rows, hmask, kv_ptr, base, valid, 0, FP8, INTERPRET)
        s += _qk_piece(q_rows, hmask, kv_ptr, base, valid, 1, FP8, INTERPRET)
        s += _qk_piece(q_rows, hmask, kv_ptr, base, valid, 2, FP8, INTERPRET)
        s += _qk_piece(q_rows, hmask, kv_ptr, base, valid, 3, FP8, INTERPRET)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: no NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
        acc0 = _pv_piece(acc0, alpha, p, kv_ptr, base, valid, 0, FP8, INTERPRET)
        acc1 = _pv_piece(acc1, alpha, p, kv_ptr, base, valid, 1, FP8, INTERPRET)
        acc2 = _pv_piece(acc2, alpha, p, kv_ptr, base, valid, 2, FP8, INTERPRET)
        acc3 = _pv_piece(acc3, alpha, p, kv_ptr, base, valid, 3, FP8, INTERPRET)

    if DIRECT:
        inv_l = tl.where(l_sum > 0, 1.0 / tl.where(l_sum > 0, l_sum, 1.0), 0.0)
        o_rows = t64 * s_o_t + heads * s_o_h
        _store_acc(out_ptr, o_rows, hmask, acc0, acc1, acc2, acc3, inv_l, INTERPRET)
        if WRITE_LSE:
            lse = tl.where(l_sum > 0, (m + tl.log2(tl.maximum(l_sum, 1e-30))) * LN2, float("-inf"))
            tl.store(lse_ptr + t64 * s_lse_t + heads, lse, mask=hmask)
    else:
        part = (t64 * H + heads) * num_splits + split
        ones = tl.full((BLOCK_H,), 1.0, tl.float32)
        _store_acc(out_ptr, part * 512, hmask, acc0, acc1, acc2, acc3, ones, False)
        tl.store(lse_ptr + part, m, mask=hmask)
        tl.store(l_ptr + part, l_sum, mask=hmask)


@triton.jit(do_not_specialize=["num_splits"])
def _sparse_mla_combine_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    lse_ptr,
    H,
    num_splits,
    s_o_t,
    s_o_h,
    s_lse_t,
    WRITE_LSE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Merge the split partials of one (token, head): out = sum acc_s 2^(m_s - M) / L."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    first = (t * H + h) * num_splits
    cols = tl.arange(0, 512)
    m_max = tl.full([], float("-inf"), tl.float32)
    for s in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(m_ptr + first + s))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros((512,), tl.float32)
    for s in range(num_splits):
        w = tl.exp2(tl.load(m_ptr + first + s) - m_safe)
        total += tl.load(l_ptr + first + s) * w
        acc += tl.load(acc_ptr + (first + s) * 512 + cols) * w
    out = acc * tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    o_ptrs = out_ptr + t * s_o_t + h * s_o_h + cols
    if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(o_ptrs, _round_to_bf16(out))
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        lse = tl.where(total > 0, (m_max + tl.log2(tl.maximum(total, 1e-30))) * LN2, float("-inf"))
        tl.store(lse_ptr + t * s_lse_t + h, lse)


# ---------------------------------------------------------------- host side

BLOCK_H = 16
BLOCK_K = 32
NUM_WARPS = 8  # 4 warps: fp8 needs ~250 registers/thread (ptxas, sm90)
TARGET_PROGRAMS = 256  # ~2 programs per SM on 132-170 SM parts
MAX_SPLITS = 16
_ALIGN = 16  # scratch regions and the scratch base, bytes
_compiled: set[tuple] = set()


@dataclass(frozen=True)
class SplitPlan:
    """How one call is split: ``num_splits`` slices of ``split_len`` indices each."""

    num_tokens: int
    num_heads: int
    num_splits: int
    split_len: int

    @property
    def direct(self) -> bool:
        """One split: the split kernel writes out/lse itself, no scratch, no combine."""
        return self.num_splits == 1

    def layout(self) -> tuple[int, int, int]:
        """(m offset, l offset, total bytes) of the partials in scratch; acc at 0."""
        if self.direct:
            return 0, 0, 0
        n = self.num_tokens * self.num_heads * self.num_splits
        m_off = n * 512 * 4
        l_off = m_off + _round_up(n * 4, _ALIGN)
        return m_off, l_off, l_off + _round_up(n * 4, _ALIGN)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def split_plan(num_tokens: int, num_heads: int, topk: int) -> SplitPlan:
    """The split of a call, from shapes only (so graphs and scratch sizing agree)."""
    return _split_plan(num_tokens, num_heads, topk, BLOCK_H, BLOCK_K, TARGET_PROGRAMS, MAX_SPLITS)


@functools.lru_cache(maxsize=4096)  # called per forward: keep it off the hot path
def _split_plan(t: int, h: int, k: int, bh: int, bk: int, target: int, cap: int) -> SplitPlan:
    chunks = _cdiv(k, bk)
    base = max(1, t * _cdiv(h, bh))
    splits = max(1, min(cap, chunks, _cdiv(target, base)))
    per = _cdiv(chunks, splits)
    return SplitPlan(t, h, _cdiv(chunks, per), per * bk)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scratch_bytes(num_tokens: int, num_heads: int, topk: int) -> int:
    """Scratch that serves every call with T <= num_tokens and top-k <= topk."""
    need = 0
    for t in range(1, num_tokens + 1):
        plan = split_plan(t, num_heads, topk)
        if plan.direct:  # splits only shrink as T grows
            break
        need = max(need, plan.layout()[2])
    return need


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _spec(v: int) -> tuple[bool, bool, bool]:
    """What Triton specialises a (specialisable) int argument on."""
    return v % 16 == 0, v == 1, v >= 2**31


def _num_stages(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    # SM12x: 99 KiB of shared memory per block, so no multi-buffering.
    return 1 if torch.cuda.get_device_capability(device)[0] == 12 else 2


def launch(
    args,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scratch: torch.Tensor | None,
    softmax_scale: float,
    kv_format: str,
) -> None:
    """Run both kernels on validated arguments (see ops.sparse_mla.dispatch)."""
    t, h, k = args.num_tokens, args.num_heads, args.topk
    if t == 0:
        return
    device = out.device
    interpret = envs.triton_interpret()
    plan = split_plan(t, h, k)
    m_off, l_off, need = plan.layout()
    if plan.direct:
        part_acc, part_m, part_l = out, (lse if lse is not None else out), out
        s_o = (out.stride(0), out.stride(1), lse.stride(0) if lse is not None else 0)
    else:
        if scratch is None:
            scratch = torch.empty(need, dtype=torch.uint8, device=device)
        part_acc = scratch[:m_off].view(torch.float32)
        part_m = scratch[m_off:l_off].view(torch.float32)
        part_l = scratch[l_off:need].view(torch.float32)
        s_o = (0, 0, 0)
    qn, qp = args.q_nope, args.q_pe
    lens = lengths if lengths is not None else indices
    pointers = (qn, qp, kv_cache, indices, lens, part_acc, part_m, part_l, out)
    ints = (h, kv_cache.shape[1], qn.stride(0), qn.stride(1), qp.stride(0), qp.stride(1))
    ints += (kv_cache.stride(0), kv_cache.stride(1), *s_o, out.stride(0), out.stride(1))
    key = (
        device,
        kv_format,
        qn.dtype,
        plan.direct,
        lengths is not None,
        lse is not None,
        tuple(p.data_ptr() % 16 == 0 for p in pointers),
        tuple(_spec(v) for v in ints),
    )
    if key not in _compiled and _capturing(device):
        raise SparseMLANotPrepared(
            f"sparse MLA variant ({kv_format}, q {qn.dtype}, "
            f"{'direct' if plan.direct else 'split-K'}, lengths={lengths is not None}, "
            f"lse={lse is not None}, H={h}) was not compiled before CUDA-graph capture: "
            "call vllm_mla.ops.sparse_mla.prewarm(...) with this cache first"
        )
    _sparse_mla_split_kernel[(t, triton.cdiv(h, BLOCK_H), plan.num_splits)](
        qn,
        qp,
        kv_cache,
        indices,
        lens,
        part_acc,
        part_m,
        part_l,
        t,
        h,
        k,
        plan.split_len,
        kv_cache.shape[1],
        softmax_scale * LOG2E,
        qn.stride(0),
        qn.stride(1),
        qp.stride(0),
        qp.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        indices.stride(0),
        *s_o,
        FP8=kv_format == "fp8_ds_mla",
        HAS_LENGTHS=lengths is not None,
        DIRECT=plan.direct,
        WRITE_LSE=lse is not None,
        BLOCK_H=BLOCK_H,
        BLOCK_K=BLOCK_K,
        INTERPRET=interpret,
        num_warps=NUM_WARPS,
        num_stages=_num_stages(device),
    )
    if not plan.direct:
        _sparse_mla_combine_kernel[(t, h)](
            part_acc,
            part_m,
            part_l,
            out,
            lse if lse is not None else part_m,
            h,
            plan.num_splits,
            out.stride(0),
            out.stride(1),
            lse.stride(0) if lse is not None else 0,
            WRITE_LSE=lse is not None,
            INTERPRET=interpret,
            num_warps=NUM_WARPS,
        )
    _compiled.add(key)


def compiled_variants() -> frozenset[tuple]:
    """Kernel variants launched so far in this process (freeze check: compare sets)."""
    return frozenset(_compiled)
