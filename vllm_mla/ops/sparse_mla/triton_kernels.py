"""Triton sparse MLA (absorbed / MQA form), split-K over the top-k indices, SM80+.

Kernel 1, ``_sparse_mla_split_kernel``, grid ``(T, cdiv(H, block_h(H)), num_splits)``:
one program takes one token, ``BLOCK_H`` heads (masked past H) and one contiguous
slice of ``split_len`` indices, walked in chunks of ``BLOCK_K`` gathered rows. Per
chunk: scores = q_pe @ k_pe^T + sum over four 128-wide latent pieces of
q_piece @ kv_piece^T (fp8: the e4m3 piece is decoded exactly to bf16 on the bits and
its group scale applied to the [BLOCK_H, BLOCK_K] partial score); online softmax in
base 2; acc_piece += p @ kv_piece (fp8: p * scale in bf16), fp32 accumulation. With
one split it writes ``out`` and ``lse`` itself; otherwise it writes unnormalised
partials (acc [512], m, l) that kernel 2, ``_sparse_mla_combine_kernel`` (grid
``(T, H)``), merges into out + lse.

Record formats (``FP8``, ``NVFP4``; neither: bf16 rows): fp8_ds_mla pieces are decoded
exactly to bf16 and their group scale applied to the partial score and to p; an
nvfp4_ds_mla piece is dequantized in the loader (e2m1 code x its e4m3 block scale, exact
in bf16: ``nvfp4_record``), so its dots are plain bf16 ones, and its RoPE is e4m3 decoded
exactly.

RoPE width (``ROPE``, 64 or 0): at 0 (latent-512 MLA without RoPE, GLM-5.3-Flash) the
q_pe @ k_pe^T piece is not traced (q_pe and the record's rope slot are never read) and the
scores are the four latent pieces alone; the ROPE=64 code is unchanged.

Attention sink (``SINK``, HY-V4's learnable per-head logit, natural log): one more term
``2^(sink log2 e)`` in the softmax denominator, added exactly once per (token, head) where
the denominator is final: the direct epilogue, or the combine kernel (never in a split's
partials). The lse then includes it. The no-sink variant (``SINK=False``) is unchanged.

Tiles (GPU): BLOCK_H = :func:`block_h` (H) heads per program, 16 for H <= 16 (tl.dot
needs >= 16 rows) and 32 above, so each gathered KV row is read from memory
``cdiv(H, BLOCK_H)`` times per token (:func:`gathered_bytes`): once for H <= 32, twice
at H = 64, four times at H = 128 (it was ``cdiv(H, 16)``: 8x at H = 128). BLOCK_K = 32,
8 warps. Why not all heads in one program: the fp32 accumulator is H x 512 x 4 bytes
(128 KiB at H = 64, the whole 256 KiB register file at H = 128), and ptxas (Triton 3.x,
this file) spills at BLOCK_H = 64 on sm90 (256-584 bytes of stack over every BLOCK_K/
warps/stages tried) and sm120 (32-248); BLOCK_H = 32 fits everywhere. Measured with
ptxas, 8 warps: BLOCK_H 16: 151 registers (fp8, sm90, 2 stages), 56 KiB shared; BLOCK_H
32: 175-223 registers (fp8, sm80/89/90/120, 1 stage), 40 KiB shared; bf16 167-178
registers, 74-76 KiB; no spills, all under the 99 KiB SM12x limit. nvfp4 walks 16 rows
a step (``CHUNK_K``; the split grain stays 32): 128-194 registers, 23-51 KiB, 2 stages.
tests/test_sparse_mla.py compiles every (arch, format, BLOCK_H) the launcher uses.
``num_stages`` (:func:`num_stages`): 1 on SM12x, and for fp8 at BLOCK_H = 32 (2 stages
spill on sm80), else 2.

Split count (shapes only, so CUDA graphs and ``scratch_bytes`` agree): enough
splits for ``TARGET_PROGRAMS`` programs (T=32, H=16, K=2048: 8 splits x 256 rows,
256 programs for 132 SMs), at most ``MAX_SPLITS``, whole chunks per split.

``INTERPRET`` (Triton's CPU interpreter only, whose bf16 dot and fp32->bf16 cast are
wrong: they round unlike a GPU's) makes every dot fp32 and rounds the bf16 output on the
bits. GPU code never takes those branches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_mla import envs
from vllm_mla.ops.capture import capturing
from vllm_mla.ops.sparse_mla import nvfp4_record
from vllm_mla.ops.sparse_mla.formats import FORMAT, ROPE, SparseMLANotPrepared
from vllm_mla.ops.triton_bits import dot, e2m1_to_f32, e4m3_to_f32, round_to_bf16

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
SINK_LOG2E = tl.constexpr(LOG2E)  # the sink is a natural-log logit; the kernels work in base 2
# nvfp4_ds_mla byte offsets (nvfp4_record): RoPE e4m3 at 256, the permuted scales at 320
NVFP4_ROPE = tl.constexpr(nvfp4_record.ROPE_OFFSET)
NVFP4_SCALES = tl.constexpr(nvfp4_record.SCALES_OFFSET)


@triton.jit
def _nvfp4_piece(kv_ptr, base, valid, PIECE: tl.constexpr, PV: tl.constexpr):
    """[BLOCK_K, 128] bf16 latent piece of gathered nvfp4_ds_mla records, dequantized
    exactly: the piece's 64 bytes (low nibble: even element) and its 8 block scales (block
    s at byte 320 + 8 (s & 3) + (s >> 2)) are loaded once each, decoded and interleaved in
    registers (join + reshape), with no FP4 instruction: the same code on every GPU."""
    rows: tl.constexpr = base.shape[0]
    j = tl.arange(0, 64)
    byte_ptrs = kv_ptr + base[:, None] + (j + PIECE * 64)[None, :]
    if PV:  # a load distinct from the QK one (see _latent_piece)
        b = tl.load(byte_ptrs, mask=valid[:, None], other=0, eviction_policy="evict_first")
    else:
        b = tl.load(byte_ptrs, mask=valid[:, None], other=0)
    s = tl.arange(0, 8) + PIECE * 8
    sf_ptrs = kv_ptr + base[:, None] + (8 * (s & 3) + (s >> 2) + NVFP4_SCALES)[None, :]
    if PV:
        sf_bits = tl.load(sf_ptrs, mask=valid[:, None], other=0, eviction_policy="evict_first")
    else:
        sf_bits = tl.load(sf_ptrs, mask=valid[:, None], other=0)
    sf = tl.reshape(tl.broadcast_to(e4m3_to_f32(sf_bits)[:, :, None], (rows, 8, 8)), (rows, 64))
    even = e2m1_to_f32(b & 0xF) * sf  # exact: <= 6 significant bits
    odd = e2m1_to_f32(b >> 4) * sf
    return tl.reshape(tl.join(even, odd), (rows, 128)).to(tl.bfloat16)


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
        x = e4m3_to_f32(x).to(tl.bfloat16)  # exact: e4m3 values are bf16 values
    return x, scale


@triton.jit
def _qk_piece(
    q_rows, hmask, kv_ptr, base, valid, PIECE: tl.constexpr, FP8: tl.constexpr, NVFP4, INTERPRET
):
    # q is reloaded per chunk (an L1 hit): held across the loop, 16x576 bf16 replicated in
    # every warp's MMA operand registers costs ~144 registers per thread and spills.
    q = tl.load(q_rows + PIECE * 128, mask=hmask[:, None], other=0.0)
    if NVFP4:
        s = dot(q, tl.trans(_nvfp4_piece(kv_ptr, base, valid, PIECE, False)), INTERPRET)
    else:
        kv, scale = _latent_piece(kv_ptr, base, valid, PIECE, FP8, False)
        s = dot(q, tl.trans(kv), INTERPRET)
        if FP8:
            s = s * scale[None, :]
    return s


@triton.jit
def _pv_piece(acc, alpha, p, kv_ptr, base, valid, PIECE: tl.constexpr, FP8, NVFP4, INTERPRET):
    if NVFP4:
        kv = _nvfp4_piece(kv_ptr, base, valid, PIECE, True)
    else:
        kv, scale = _latent_piece(kv_ptr, base, valid, PIECE, FP8, True)
        if FP8:
            p = p * scale[None, :]
    return acc * alpha[:, None] + dot(p, kv, INTERPRET)


@triton.jit
def _store_out(ptr, rows, cols, mask, val, INTERPRET: tl.constexpr):
    if INTERPRET and ptr.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16(val)
    else:
        out = val.to(ptr.dtype.element_ty)
    tl.store(ptr + rows[:, None] + cols[None, :], out, mask=mask[:, None])


@triton.jit
def _sink_weight(s2, m_safe):
    """``2^(s2 - m_safe)``: the sink's (base-2 logit ``s2``) share of a denominator taken
    relative to ``m_safe`` (the max of the logits and the sink, 0 when that is -inf). A
    -inf sink weighs 0; a +inf sink is the max itself, weight 1 (no ``inf - inf``), so
    every other weight is 0: out 0, lse +inf."""
    inf = s2 == float("inf")
    return tl.where(inf, 1.0, tl.exp2(tl.where(inf, 0.0, s2) - m_safe))


@triton.jit
def _store_acc(ptr, rows, mask, acc0, acc1, acc2, acc3, inv_l, INTERPRET: tl.constexpr):
    cols = tl.arange(0, 128)
    _store_out(ptr, rows, cols, mask, acc0 * inv_l[:, None], INTERPRET)
    _store_out(ptr, rows, cols + 128, mask, acc1 * inv_l[:, None], INTERPRET)
    _store_out(ptr, rows, cols + 256, mask, acc2 * inv_l[:, None], INTERPRET)
    _store_out(ptr, rows, cols + 384, mask, acc3 * inv_l[:, None], INTERPRET)


@triton.jit(
    # req/bt_ptr, s_bt, bt_width: vLLM's block table and request map are read once per
    # program; not specializing on them keeps the probes' variant the live one
    do_not_specialize=[
        *("T", "K", "split_len", "s_idx", "num_rows", "m_off", "l_off"),
        *("req_ptr", "bt_ptr", "s_bt", "bt_width", "dcp_period", "dcp_start", "dcp_interleave"),
        "sink_ptr",  # read once per program: its alignment is not worth a variant
    ]
)
def _sparse_mla_split_kernel(
    qn_ptr,
    qp_ptr,
    kv_ptr,
    idx_ptr,
    len_ptr,
    out_ptr,  # DIRECT: out [T, H, 512]; else the uint8 scratch (partial acc at 0)
    lse_ptr,  # DIRECT: lse [T, H]; else the scratch (partial m at m_off, base-2 units)
    l_ptr,  # the scratch (partial l at l_off; unused when DIRECT)
    err_ptr,  # int32 [1]: out-of-range indices counted (HAS_ERR)
    sink_ptr,  # SINK and DIRECT: fp32 [H] natural-log sink logits (split partials: unused)
    req_ptr,  # LOGICAL: int32 [>= T] request of each token (vLLM's req_id_per_token)
    bt_ptr,  # LOGICAL: int32 [requests, bt_width] block table
    s_bt,  # LOGICAL: block table row stride
    bt_width,  # LOGICAL: blocks per request row
    dcp_period,  # DCP (ops.dcp.DCPShard): group size x interleave N * I
    dcp_start,  # DCP: this rank's first position in a period, rank * I
    dcp_interleave,  # DCP: cp_kv_cache_interleave_size I
    m_off,  # fp32 elements from the scratch base to the partial m [T, H, S]
    l_off,  # fp32 elements from the scratch base to the partial l [T, H, S]
    T,
    H,
    K,
    split_len,
    block_size,
    num_rows,
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
    NVFP4: tl.constexpr,  # nvfp4_ds_mla records (dequantized in the loader)
    HAS_LENGTHS: tl.constexpr,
    DIRECT: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    HAS_ERR: tl.constexpr,
    LOGICAL: tl.constexpr,
    DCP: tl.constexpr,  # LOGICAL rows are request positions of a DCP group
    SINK: tl.constexpr,  # a per-head sink joins the denominator (DIRECT: here, else combine)
    ROPE: tl.constexpr,  # qk_rope_head_dim: 64, or 0 (no q_pe . k_pe piece)
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
    if ROPE > 0:
        r = tl.arange(0, ROPE)
        qpe_ptrs = qp_ptr + t64 * s_qp_t + heads[:, None] * s_qp_h + r[None, :]

    end = K
    if HAS_LENGTHS:
        end = tl.minimum(tl.load(len_ptr + t), K)  # contiguous (launch() sees to it)
    start = split * split_len
    end = tl.minimum(end, start + split_len)

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, 128), tl.float32)
    acc1 = tl.zeros((BLOCK_H, 128), tl.float32)
    acc2 = tl.zeros((BLOCK_H, 128), tl.float32)
    acc3 = tl.zeros((BLOCK_H, 128), tl.float32)
    bad = tl.zeros((BLOCK_K,), tl.int32)
    if LOGICAL:
        bt_row = bt_ptr + tl.load(req_ptr + t).to(tl.int64) * s_bt
    for k0 in range(start, end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        rows = tl.load(idx_ptr + t64 * s_idx + ks, mask=ks < end, other=-1)
        if LOGICAL:
            # vLLM's logical -> physical map (triton_convert_req_index_to_global_index;
            # under DCP triton_filter_and_convert_dcp_index), fused: negative, past the
            # block table or (DCP) a request position another rank holds -> -1 (empty,
            # uncounted); under DCP the rank's local position is what its table maps.
            if DCP:  # rank r holds p when p % (N * I) is in [r * I, r * I + I)
                turn = rows // dcp_period
                off = rows - turn * dcp_period - dcp_start
                held = (rows >= 0) & (off >= 0) & (off < dcp_interleave)
                local = turn * dcp_interleave + off
                mapped = held & (local < bt_width * block_size)
                logical = tl.where(mapped, local, 0)
            else:
                mapped = (rows >= 0) & (rows < bt_width * block_size)
                logical = tl.where(mapped, rows, 0)
            page = tl.load(bt_row + logical // block_size, mask=mapped, other=0)
            rows = tl.where(mapped, page * block_size + logical % block_size, -1)
        # INDEX_RULE: outside [-1, num_rows) reads as empty (never a stray read), counted
        in_range = (rows >= -1) & (rows < num_rows)
        if HAS_ERR:
            bad += (~in_range).to(tl.int32)
        valid = (rows >= 0) & in_range
        rows = tl.where(valid, rows, 0)
        base = (rows // block_size).to(tl.int64) * s_kv_b + (rows % block_size) * s_kv_t
        if ROPE > 0:
            if NVFP4:  # e4m3, unscaled: decoded exactly
                pe_bits = tl.load(
                    kv_ptr + base[:, None] + NVFP4_ROPE + r[None, :], mask=valid[:, None], other=0
                )
                kpe = e4m3_to_f32(pe_bits).to(tl.bfloat16)
            else:
                if FP8:
                    pe_ptrs = (kv_ptr + base[:, None] + 528).to(tl.pointer_type(tl.bfloat16))
                else:
                    pe_ptrs = kv_ptr + base[:, None] + 512
                kpe = tl.load(pe_ptrs + r[None, :], mask=valid[:, None], other=0.0)
            qpe = tl.load(qpe_ptrs, mask=hmask[:, None], other=0.0)
            s = dot(qpe, tl.trans(kpe), INTERPRET)
            s += _qk_piece(q_rows, hmask, kv_ptr, base, valid, 0, FP8, NVFP4, INTERPRET)
        else:  # no RoPE: the latent pieces alone
            s = _qk_piece(q_rows, hmask, kv_ptr, base, valid, 0, FP8, NVFP4, INTERPRET)
        s += _qk_piece(q_rows, hmask, kv_ptr, base, valid, 1, FP8, NVFP4, INTERPRET)
        s += _qk_piece(q_rows, hmask, kv_ptr, base, valid, 2, FP8, NVFP4, INTERPRET)
        s += _qk_piece(q_rows, hmask, kv_ptr, base, valid, 3, FP8, NVFP4, INTERPRET)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-masked so far: no NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
        acc0 = _pv_piece(acc0, alpha, p, kv_ptr, base, valid, 0, FP8, NVFP4, INTERPRET)
        acc1 = _pv_piece(acc1, alpha, p, kv_ptr, base, valid, 1, FP8, NVFP4, INTERPRET)
        acc2 = _pv_piece(acc2, alpha, p, kv_ptr, base, valid, 2, FP8, NVFP4, INTERPRET)
        acc3 = _pv_piece(acc3, alpha, p, kv_ptr, base, valid, 3, FP8, NVFP4, INTERPRET)

    if HAS_ERR:  # noqa: SIM102 (a constexpr branch; Triton cannot mix it into `and`)
        if tl.program_id(1) == 0:  # one head group per (token, split) counts its slice
            tl.atomic_add(err_ptr, tl.sum(bad))
    if DIRECT:
        if SINK:  # the one place a direct call adds it: m, l become the final M, total
            s2 = tl.load(sink_ptr + heads, mask=hmask, other=float("-inf")) * SINK_LOG2E
            m_all = tl.maximum(m, s2)
            m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
            alpha = tl.exp2(m - m_safe)  # the accumulator's factor (0 with no valid row)
            l_sum = l_sum * alpha + _sink_weight(s2, m_safe)
            m = m_all
            inv_l = tl.where(l_sum > 0, alpha / tl.where(l_sum > 0, l_sum, 1.0), 0.0)
        else:
            inv_l = tl.where(l_sum > 0, 1.0 / tl.where(l_sum > 0, l_sum, 1.0), 0.0)
        o_rows = t64 * s_o_t + heads * s_o_h
        _store_acc(out_ptr, o_rows, hmask, acc0, acc1, acc2, acc3, inv_l, INTERPRET)
        if WRITE_LSE:
            lse = tl.where(l_sum > 0, (m + tl.log2(tl.maximum(l_sum, 1e-30))) * LN2, float("-inf"))
            tl.store(lse_ptr + t64 * s_lse_t + heads, lse, mask=hmask)
    else:
        part = (t64 * H + heads) * num_splits + split
        ones = tl.full((BLOCK_H,), 1.0, tl.float32)
        acc_base = out_ptr.to(tl.pointer_type(tl.float32))
        _store_acc(acc_base, part * 512, hmask, acc0, acc1, acc2, acc3, ones, False)
        tl.store(lse_ptr.to(tl.pointer_type(tl.float32)) + m_off + part, m, mask=hmask)
        tl.store(l_ptr.to(tl.pointer_type(tl.float32)) + l_off + part, l_sum, mask=hmask)


@triton.jit(do_not_specialize=["num_splits", "m_off", "l_off", "sink_ptr"])
def _sparse_mla_combine_kernel(
    scratch_ptr,  # uint8: partial acc at 0, m at m_off, l at l_off (fp32 elements)
    m_off,
    l_off,
    out_ptr,
    lse_ptr,
    sink_ptr,  # SINK: fp32 [H] natural-log sink logits
    H,
    num_splits,
    s_o_t,
    s_o_h,
    s_lse_t,
    WRITE_LSE: tl.constexpr,
    SINK: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Merge the split partials of one (token, head): out = sum acc_s 2^(m_s - M) / L;
    with ``SINK`` the sink joins M and L here, once (the splits never add it)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    acc_ptr = scratch_ptr.to(tl.pointer_type(tl.float32))
    m_ptr = acc_ptr + m_off
    l_ptr = acc_ptr + l_off
    first = (t * H + h) * num_splits
    cols = tl.arange(0, 512)
    m_max = tl.full([], float("-inf"), tl.float32)
    for s in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(m_ptr + first + s))
    if SINK:
        s2 = tl.load(sink_ptr + h) * SINK_LOG2E
        m_max = tl.maximum(m_max, s2)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros((512,), tl.float32)
    for s in range(num_splits):
        w = tl.exp2(tl.load(m_ptr + first + s) - m_safe)
        total += tl.load(l_ptr + first + s) * w
        acc += tl.load(acc_ptr + (first + s) * 512 + cols) * w
    if SINK:
        total += _sink_weight(s2, m_safe)
    out = acc * tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    o_ptrs = out_ptr + t * s_o_t + h * s_o_h + cols
    if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(o_ptrs, round_to_bf16(out))
    else:
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))
    if WRITE_LSE:
        lse = tl.where(total > 0, (m_max + tl.log2(tl.maximum(total, 1e-30))) * LN2, float("-inf"))
        tl.store(lse_ptr + t * s_lse_t + h, lse)


# ---------------------------------------------------------------- host side

BLOCK_H = 16  # the smallest head tile (tl.dot's minimum M); see block_h
WIDE_BLOCK_H = 32  # the widest head tile that compiles without spills (module docstring)
BLOCK_K = 32  # the split grain (split_len is a multiple of it), and bf16/fp8's chunk
# Gathered rows per loop step, per loader (FORMAT[...].reader); each divides BLOCK_K.
# nvfp4's in-register dequant spills at 32 (ptxas sm90, 32 heads: 255 registers + 80-96
# bytes of stack); at 16 it takes 128-194 registers with 2 stages on sm80/89/90.
CHUNK_K = {"bf16": BLOCK_K, "fp8": BLOCK_K, "nvfp4": 16}
NUM_WARPS = 8  # 4 warps: fp8 needs ~250 registers/thread (ptxas, sm90)
TARGET_PROGRAMS = 256  # ~2 programs per SM on 132-170 SM parts
MAX_SPLITS = 16
_ALIGN = 16  # scratch regions and the scratch base, bytes
_compiled: set[tuple] = set()
_sites: dict[tuple, LaunchSite] = {}  # site_for()'s sites (they hold no tensor)


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
        return m_off, l_off, _partials_bytes(n)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def block_h(num_heads: int) -> int:
    """Heads per program for ``num_heads`` heads (see the module docstring)."""
    return BLOCK_H if num_heads <= BLOCK_H else WIDE_BLOCK_H


def gathered_bytes(num_heads: int, topk: int, kv_format: str) -> int:
    """KV bytes the split kernel loads from memory per token: each of the ``topk`` gathered
    records once per head tile (the kernel's own accounting, reported by the benchmark)."""
    from vllm_mla.ops.sparse_mla.formats import record_bytes

    return _cdiv(num_heads, block_h(num_heads)) * topk * record_bytes(kv_format)


def split_plan(num_tokens: int, num_heads: int, topk: int) -> SplitPlan:
    """The split of a call, from shapes only (so graphs and scratch sizing agree)."""
    bh = block_h(num_heads)
    return _split_plan(num_tokens, num_heads, topk, bh, BLOCK_K, TARGET_PROGRAMS, MAX_SPLITS)


@functools.lru_cache(maxsize=4096)  # called per forward: keep it off the hot path
def _split_plan(t: int, h: int, k: int, bh: int, bk: int, target: int, cap: int) -> SplitPlan:
    chunks = _cdiv(k, bk)
    base = max(1, t * _cdiv(h, bh))
    splits = max(1, min(cap, chunks, _cdiv(target, base)))
    per = _cdiv(chunks, splits)
    return SplitPlan(t, h, _cdiv(chunks, per), per * bk)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _partials_bytes(n: int) -> int:
    """Scratch bytes of ``n`` (token, head, split) partials: acc [512] fp32, m, l."""
    return n * 512 * 4 + 2 * _round_up(n * 4, _ALIGN)


def _split_bound(t: int, h: int, k: int) -> int:
    """An upper bound of ``split_plan(t, h, k').num_splits`` for every k' <= k: the split
    count before whole-chunk rounding, which only lowers it, and which grows with k."""
    base = max(1, t * _cdiv(h, block_h(h)))
    return max(1, min(MAX_SPLITS, _cdiv(k, BLOCK_K), _cdiv(TARGET_PROGRAMS, base)))


@functools.lru_cache(maxsize=1024)
def scratch_bytes(num_tokens: int, num_heads: int, topk: int) -> int:
    """Scratch that serves every call with T <= num_tokens, H <= num_heads and top-k <=
    topk; monotone in all three (a tested property). Exact split counts are not (rounding
    to whole chunks makes them jump with K, and more heads mean fewer splits), so this is
    the maximum over T and H of a bound that is monotone in K."""
    need = 0
    for h in range(1, num_heads + 1):
        for t in range(1, num_tokens + 1):
            splits = _split_bound(t, h, topk)
            if splits == 1:  # direct from here on: splits only shrink as T grows
                break
            need = max(need, _partials_bytes(t * h * splits))
    return need


def _spec(v: int) -> tuple[bool, bool, bool]:
    """What Triton specialises a (specialisable) int argument on."""
    return v % 16 == 0, v == 1, v >= 2**31


def num_stages(major: int, fp8: bool, heads_per_program: int) -> int:
    """Software-pipelining stages for a CUDA device of compute capability ``major``."""
    if major == 12:  # SM12x: 99 KiB of shared memory per block, so no multi-buffering
        return 1
    if fp8 and heads_per_program > BLOCK_H:  # 2 stages spill on sm80 (ptxas)
        return 1
    return 2


def _num_stages(device: torch.device, fp8: bool, heads_per_program: int) -> int:
    if device.type != "cuda":
        return 1
    major = torch.cuda.get_device_capability(device)[0]
    return num_stages(major, fp8, heads_per_program)


def site_for(
    kv_cache: torch.Tensor,
    num_heads: int,
    topk: int,
    kv_format: str,
    softmax_scale: float,
    q_dtype: torch.dtype,
    rope: int = ROPE,
) -> LaunchSite:
    """The cached ``LaunchSite`` of this cache geometry and call shape (the library path's;
    a bound decode call keeps its own)."""
    key = (kv_cache.device, kv_cache.shape[:2], kv_cache.stride()[:2], kv_cache.data_ptr() & 15)
    key += (num_heads, topk, kv_format, softmax_scale, q_dtype, rope)
    site = _sites.get(key)
    if site is None:
        if len(_sites) > 64:  # bounded: the (cache geometry, call shape) pairs seen
            _sites.clear()
        site = _sites[key] = LaunchSite(
            kv_cache, num_heads, topk, kv_format, softmax_scale, q_dtype, rope=rope
        )
    return site


@dataclass(frozen=True)
class _Split:
    """What one token count launches: its split plan, scratch offsets and grids."""

    plan: SplitPlan
    m_off: int  # fp32 elements
    l_off: int
    need: int  # scratch bytes
    grid: tuple[int, int, int]
    combine_grid: tuple[int, int]
    split_len: int
    num_splits: int


class LaunchSite:
    """Both kernels' launch for one (cache geometry, H, K, format, scale, q dtype): what
    those fix is computed once (split plans per token count, the cache's strides and the
    variant key's fixed part), so a call reads a few pointers and strides and launches.

    Holds no tensor (the cache is passed per call; only its geometry is kept): a site
    never keeps a KV pool alive. ``launch`` serves any cache of the same geometry.
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        topk: int,
        kv_format: str,
        softmax_scale: float,
        q_dtype: torch.dtype,
        rope: int = ROPE,
    ) -> None:
        self.device = kv_cache.device
        self.rope = rope  # qk_rope_head_dim: 64, or 0 (q_pe and the rope slot unread)
        self.num_heads, self.topk, self.kv_format = num_heads, topk, kv_format
        self.block_h = block_h(num_heads)
        reader = FORMAT[kv_format].reader  # "bf16", "fp8" or "nvfp4": the kernel's loader
        self.fp8, self.nvfp4 = reader == "fp8", reader == "nvfp4"
        self.qk_scale = softmax_scale * LOG2E
        self.block_size = kv_cache.shape[1]
        self.num_rows = kv_cache.shape[0] * kv_cache.shape[1]
        self.kv_strides = (kv_cache.stride(0), kv_cache.stride(1))
        self.kv_aligned = kv_cache.data_ptr() % 16 == 0
        self.fixed = (self.device, kv_format, q_dtype, self.block_h)
        if rope != ROPE:  # rope-64 variant keys stay as they were
            self.fixed += (rope,)
        self.fixed_specs = tuple(_spec(v) for v in (num_heads, self.block_size, *self.kv_strides))
        self.interpret = envs.triton_interpret()
        self.num_stages = _num_stages(self.device, self.fp8, self.block_h)
        self.block_k = CHUNK_K[reader]
        self._splits: dict[int, _Split] = {}
        self._keys: dict[tuple, tuple] = {}  # a launched call's raw description -> its key
        self._registry = _compiled  # the variant set _keys was filled against
        self._consts: dict[tuple, dict] = {}

    def matches(self, kv_cache: torch.Tensor) -> bool:
        """Whether ``kv_cache`` has the geometry this site was built for."""
        return (
            kv_cache.device == self.device
            and kv_cache.shape[0] * kv_cache.shape[1] == self.num_rows
            and kv_cache.shape[1] == self.block_size
            and (kv_cache.stride(0), kv_cache.stride(1)) == self.kv_strides
            and (kv_cache.data_ptr() % 16 == 0) == self.kv_aligned
        )

    def split(self, num_tokens: int) -> _Split:
        hit = self._splits.get(num_tokens)
        if hit is None:
            plan = split_plan(num_tokens, self.num_heads, self.topk)
            m_off, l_off, need = plan.layout()
            hit = self._splits[num_tokens] = _Split(
                plan,
                m_off // 4,
                l_off // 4,
                need,
                (num_tokens, triton.cdiv(self.num_heads, self.block_h), plan.num_splits),
                (num_tokens, self.num_heads),
                plan.split_len,
                plan.num_splits,
            )
        return hit

    def _key(self, raw: tuple) -> tuple:
        """The variant key (what Triton specializes on) of a call's ``raw`` description:
        (direct, flags, pointer alignments mod 16, q/out strides, lse stride)."""
        direct, flags, aligns, s_qn, s_qp, s_out, s_lse = raw
        ints = (s_qn[0], s_qn[1], s_qp[0], s_qp[1], s_out[0] if direct else 0)
        ints += (s_out[1] if direct else 0, s_lse if direct else 0, s_out[0], s_out[1])
        return (
            *self.fixed,
            direct,
            flags,
            self.kv_aligned,
            tuple(a == 0 for a in aligns),
            self.fixed_specs,
            tuple(_spec(v) for v in ints),
        )

    def _constants(self, direct: bool, flags: tuple) -> dict:
        consts = self._consts.get((direct, flags))
        if consts is None:
            consts = self._consts[(direct, flags)] = dict(
                FP8=self.fp8,
                NVFP4=self.nvfp4,
                HAS_LENGTHS=flags[0],
                DIRECT=direct,
                WRITE_LSE=flags[1],
                HAS_ERR=flags[2],
                LOGICAL=flags[3],
                DCP=flags[4],
                SINK=flags[5],
                ROPE=self.rope,
                BLOCK_H=self.block_h,
                BLOCK_K=self.block_k,
                INTERPRET=self.interpret,
                num_warps=NUM_WARPS,
                num_stages=self.num_stages,
            )
        return consts

    def launch(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        out: torch.Tensor,
        scratch: torch.Tensor | None,
        lengths: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        invalid: torch.Tensor | None = None,
        req_id: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        dcp: tuple[int, int, int] = (1, 0, 1),
        sink: torch.Tensor | None = None,
    ) -> bool:
        """Run both kernels on validated arguments (``out [T, H, 512]`` written); True
        when the call's variant was new to the process (``compiled_variants()`` grew).

        With ``req_id`` (int32, >= T entries) and ``block_table`` (int32 ``[requests,
        blocks]``, block size = the cache's) ``indices`` are LOGICAL top-k positions,
        mapped to physical rows in the kernel exactly as vLLM's conversion kernel maps
        them (``selection.logical_to_physical`` is the torch reference). ``dcp``:
        ``DCPShard.args`` (size, rank, interleave) of this rank; with size > 1 the
        logical positions are request positions of the whole DCP group and only those
        this rank holds are attended (its local positions mapped through its block
        table), the others are empty: one more variant (``DCP``), whatever the rank
        (runtime values), and the non-DCP variant unchanged (no extra registers).
        ``sink``: fp32 ``[H]`` natural-log logits, one more term of each head's softmax
        denominator (module docstring; a variant of its own, ``SINK``).

        A call whose variant this site already launched skips the variant bookkeeping
        (one dict lookup); a new one is checked against CUDA-graph capture first.
        """
        t = indices.shape[0]
        if t == 0:
            return False
        if q_pe.shape[-1] != self.rope:
            raise ValueError(
                f"q_pe: this site serves qk_rope_head_dim {self.rope}, got {tuple(q_pe.shape)}"
            )
        if not self.rope:  # never read: q_nope stands in (an empty q_pe may hold no pointer)
            q_pe = q_nope
        sp = self._splits.get(t) or self.split(t)
        direct = sp.plan.direct
        lens = lengths if lengths is not None else indices
        err = invalid if invalid is not None else lens
        if direct:
            acc, part_m = out, (lse if lse is not None else out)
        else:
            if scratch is None:
                scratch = torch.empty(sp.need, dtype=torch.uint8, device=self.device)
            elif scratch.numel() < sp.need:
                raise ValueError(
                    f"scratch: expected at least {sp.need} bytes for T={t}, got {scratch.numel()}"
                )
            acc = part_m = scratch
        logical = block_table is not None
        if logical:
            s_bt, bt_width = block_table.stride(0), block_table.shape[1]
        else:
            req_id, block_table, s_bt, bt_width = indices, indices, 0, 0
        s_qn, s_qp, s_out = q_nope.stride(), q_pe.stride(), out.stride()
        s_lse = lse.stride(0) if lse is not None else 0
        dcp_on = logical and dcp[0] > 1
        size, rank, interleave = dcp
        flags = (lengths is not None, lse is not None, invalid is not None, logical, dcp_on)
        flags += (sink is not None,)
        sink_arg = sink if sink is not None else lens  # never read without SINK
        aligns = (
            q_nope.data_ptr() & 15,
            q_pe.data_ptr() & 15,
            indices.data_ptr() & 15,
            lens.data_ptr() & 15,
            acc.data_ptr() & 15,
            part_m.data_ptr() & 15,
            err.data_ptr() & 15,
            out.data_ptr() & 15,
        )
        raw = (direct, flags, aligns, s_qn, s_qp, s_out, s_lse)
        if self._registry is not _compiled:  # the variant set was replaced (tests)
            self._keys.clear()
            self._registry = _compiled
        key = self._keys.get(raw)
        new = key is None
        if new:
            key = self._key(raw)
            if key not in _compiled and capturing(self.device):
                raise SparseMLANotPrepared(
                    f"sparse MLA variant ({self.kv_format}, q {q_nope.dtype}, "
                    f"{'direct' if direct else 'split-K'}, lengths={flags[0]}, "
                    f"lse={flags[1]}, sink={flags[5]}, H={self.num_heads}) was not compiled "
                    "before CUDA-graph capture: call vllm_mla.ops.sparse_mla.prewarm(...) with "
                    "this cache first"
                )
        s_o = (s_out[0], s_out[1], s_lse) if direct else (0, 0, 0)
        _sparse_mla_split_kernel[sp.grid](
            q_nope,
            q_pe,
            kv_cache,
            indices,
            lens,
            acc,
            part_m,
            part_m,
            err,
            sink_arg,
            req_id,
            block_table,
            s_bt,
            bt_width,
            size * interleave,
            rank * interleave,
            interleave,
            sp.m_off,
            sp.l_off,
            t,
            self.num_heads,
            self.topk,
            sp.split_len,
            self.block_size,
            self.num_rows,
            self.qk_scale,
            s_qn[0],
            s_qn[1],
            s_qp[0],
            s_qp[1],
            self.kv_strides[0],
            self.kv_strides[1],
            indices.stride(0),
            *s_o,
            **self._consts.get((direct, flags)) or self._constants(direct, flags),
        )
        if not direct:
            _sparse_mla_combine_kernel[sp.combine_grid](
                scratch,
                sp.m_off,
                sp.l_off,
                out,
                lse if lse is not None else out,
                sink_arg,
                self.num_heads,
                sp.num_splits,
                s_out[0],
                s_out[1],
                s_lse,
                WRITE_LSE=flags[1],
                SINK=flags[5],
                INTERPRET=self.interpret,
                num_warps=NUM_WARPS,
            )
        if not new:
            return False
        if len(self._keys) > 256:  # bounded: the strides/alignments one site sees
            self._keys.clear()
        self._keys[raw] = key
        added = key not in _compiled
        _compiled.add(key)
        return added


def compiled_variants() -> frozenset[tuple]:
    """Kernel variants launched so far in this process (freeze check: compare sets)."""
    return frozenset(_compiled)
