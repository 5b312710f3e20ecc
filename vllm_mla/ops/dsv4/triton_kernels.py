"""DeepSeek-V4's record writer and sparse attention in Triton, for every GPU from SM80: no
fp8 type or instruction (``tl.float8e4nv`` needs SM89+), every fp8 value encoded and
decoded on the bits (``triton_bits``).

``_dsv4_write_kernel``, grid ``(T,)``: one token's 584-byte record (``record``'s layout
and either writer rule, ``CPU_RULE``). The block exponent is ``ceil(log2(ratio))`` taken
on the bits (exact: the exponent, plus one when the mantissa is not zero); the scaled
value ``x * 2**-e`` is exact, so the bytes equal ``record.quantize``'s wherever torch's
fp32 ``log2`` rounds to the true ceiling (everywhere but a ratio within 2**-21 of a power
of two above it, where torch's can give the lower exponent and saturate one value).

``_dsv4_attend_kernel``, grid ``(T, cdiv(H, BLOCK_H))``: one program takes one token and
``BLOCK_H`` heads (masked past H: ``block_h``) and walks the window slots, then the
compressed ones, ``BLOCK_K`` records at a time. A record is taken in eight 64-wide pieces:
seven of e4m3 NoPE values, decoded exactly to bf16 with their power-of-two scale applied
to the partial score and to ``p``, and the bf16 RoPE part; per piece ``s += q . k`` (bf16
in, fp32 accumulation), then ``acc_piece += p . k`` with ``p`` rounded to bf16 (vLLM's
kernels round the probabilities too; rounding ``p * 2**e`` is rounding ``p``). The
pieces are reloaded for the PV dots (an L1 hit) rather than held across the softmax.
One online softmax in base 2 covers both sources; the sink starts it (``m = sink``,
``l = 1``): a term in the denominator with no value. No token and no sink: zeros.

``INTERPRET`` (Triton's CPU interpreter, whose bf16 dots and casts round unlike a GPU's):
the dots run in fp32 on the same bf16 values, ``p`` and the output rounded on the bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mla.formats import (
    DSV4_DATA_BYTES,
    DSV4_FLOOR,
    DSV4_HEAD,
    DSV4_NOPE,
    DSV4_QUANT_BLOCK,
    DSV4_SCALE_BYTES,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E8M0_BIAS,
    ROPE,
)
from vllm_mla.ops.triton_bits import dot, e4m3_to_f32, f32_to_e4m3, round_to_bf16

LOG2E = 1.4426950408889634
BLOCK_K = 32  # records gathered per step
NUM_WARPS = 8  # 4 warps: 255 registers and spills (ptxas, sm90 / sm120)
NUM_STAGES = 1
WRITE_WARPS = 2
COMPRESS_WARPS = 4
COMPRESS_BLOCK_D = 32  # channels a step (C128: 128 rows of them; 64: 220-244 registers)
_HEAD = tl.constexpr(DSV4_HEAD)
_ROPE = tl.constexpr(DSV4_HEAD - DSV4_NOPE)
_NOPE = tl.constexpr(DSV4_NOPE)
_QBLOCK = tl.constexpr(DSV4_QUANT_BLOCK)
_DATA = tl.constexpr(DSV4_DATA_BYTES)
_SCALES = tl.constexpr(DSV4_SCALE_BYTES)
_MAX = tl.constexpr(E4M3_MAX)
_MIN_NORMAL = tl.constexpr(E4M3_MIN_NORMAL)
_FLOOR = tl.constexpr(DSV4_FLOOR)
_BIAS = tl.constexpr(E8M0_BIAS)
_LOG2E = tl.constexpr(LOG2E)  # the sink is a natural-log logit; the softmax runs in base 2


def block_h(heads: int) -> int:
    """Heads per program: 16 (``tl.dot`` needs 16 rows; each record is read once per 16
    heads). Measured with ptxas (8 warps, 1 stage, sm80 / 89 / 90 / 120): 16 heads x 32
    records 206-207 registers under Triton 3.6, 172-174 under 3.9, 21 KiB shared, no
    spill; 32 heads reach 255 registers and spill under one Triton or the other."""
    del heads
    return 16


@triton.jit
def _ceil_log2(x):
    """``ceil(log2(x))`` of a positive normal fp32, exact, on the bits."""
    bits = x.to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF).to(tl.int32) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _pow2(code):
    """``2**(code - 127)`` for an E8M0 code in [1, 254], built on the bits."""
    return (code.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _dsv4_write_kernel(
    rows_ptr,
    slot_ptr,
    cache_ptr,
    s_rt,
    s_page,
    block_size,
    CPU_RULE: tl.constexpr,  # vLLM CPU's _C rule; else vLLM's Triton writers'
):
    t = tl.program_id(0)
    raw = tl.load(slot_ptr + t).to(tl.int64)
    slot = tl.maximum(raw, 0)  # a slot < 0 (padded token) writes nothing
    page = cache_ptr + (slot // block_size) * s_page
    data = page + (slot % block_size) * _DATA
    scales = page + block_size * _DATA + (slot % block_size) * _SCALES
    src = rows_ptr + t.to(tl.int64) * s_rt

    blk = tl.arange(0, 8)  # 7 NoPE blocks and the pad byte
    col = tl.arange(0, _QBLOCK)
    in_nope = (blk < _NOPE // _QBLOCK)[:, None] & (col >= 0)[None, :]
    x = tl.load(src + blk[:, None] * _QBLOCK + col[None, :], mask=in_nope, other=0.0)
    x = round_to_bf16(x.to(tl.float32)).to(tl.float32)  # writers quantize the bf16 row
    amax = tl.max(tl.abs(x), axis=1)
    if CPU_RULE:
        ratio = tl.maximum(tl.math.div_rn(amax, _MAX), _FLOOR)
    else:
        ratio = tl.math.div_rn(tl.maximum(amax, _FLOOR), _MAX)
    exponent = _ceil_log2(ratio)
    inv = ((127 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**-exponent, exact
    v = tl.minimum(tl.maximum(x * inv[:, None], -_MAX), _MAX)
    codes = f32_to_e4m3(v)
    if CPU_RULE:  # under e4m3's smallest normal: a zero of the value's sign
        sign = ((v.to(tl.uint32, bitcast=True) >> 31) << 7).to(tl.uint8)
        codes = tl.where(tl.abs(v) < _MIN_NORMAL, sign, codes)
    ok = (blk + raw) >= blk  # masks as tensors (the interpreter takes no scalar mask)
    tl.store(data + blk[:, None] * _QBLOCK + col[None, :], codes, mask=in_nope & ok[:, None])
    code = tl.minimum(tl.maximum(exponent + _BIAS, 0), 255)
    code = tl.where(blk < _NOPE // _QBLOCK, code, 0).to(tl.uint8)
    tl.store(scales + blk, code, mask=ok)

    r = tl.arange(0, _ROPE)
    pe = round_to_bf16(tl.load(src + _NOPE + r).to(tl.float32))
    tl.store((data + _NOPE).to(tl.pointer_type(tl.bfloat16)) + r, pe, mask=(r + raw) >= r)


@triton.jit
def _piece(data, scales, valid, PIECE: tl.constexpr, PV: tl.constexpr):
    """[BLOCK_K, 64] bf16 piece ``PIECE`` of the gathered records, exact, and its [BLOCK_K]
    scale: pieces 0-6 the e4m3 NoPE values unscaled (their power-of-two scale is applied to
    the partial score and to p), piece 7 the bf16 RoPE part (scale 1)."""
    c = tl.arange(0, _QBLOCK)
    if PIECE == _NOPE // _QBLOCK:
        ptrs = (data + _NOPE).to(tl.pointer_type(tl.bfloat16))[:, None] + c[None, :]
        scale = tl.full(valid.shape, 1.0, tl.float32)
    else:
        ptrs = data[:, None] + PIECE * _QBLOCK + c[None, :]
        scale = _pow2(tl.load(scales + PIECE, mask=valid, other=127))
    if PV:  # a load distinct from the QK one (last use), so the two are not kept live
        x = tl.load(ptrs, mask=valid[:, None], other=0, eviction_policy="evict_first")
    else:
        x = tl.load(ptrs, mask=valid[:, None], other=0)
    if PIECE != _NOPE // _QBLOCK:
        x = e4m3_to_f32(x).to(tl.bfloat16)  # exact: e4m3 values are bf16 values
    return x, scale


@triton.jit
def _qk(q_rows, hmask, data, scales, valid, PIECE: tl.constexpr, INTERPRET: tl.constexpr):
    # q is reloaded per chunk (an L1 hit): held across the loop it spills
    q = tl.load(q_rows + PIECE * _QBLOCK, mask=hmask[:, None], other=0.0)
    k, scale = _piece(data, scales, valid, PIECE, False)
    return dot(q, tl.trans(k), INTERPRET) * scale[None, :]


@triton.jit
def _pv(acc, alpha, p, data, scales, valid, PIECE: tl.constexpr, INTERPRET: tl.constexpr):
    v, scale = _piece(data, scales, valid, PIECE, True)
    w = p * scale[None, :]  # rounding p * 2**e to bf16 is rounding p: the same weights
    if INTERPRET:
        w = round_to_bf16(w).to(tl.float32)
    return acc * alpha[:, None] + dot(w.to(tl.bfloat16), v, INTERPRET)


@triton.jit
def _attend_source(
    q_rows, hmask, m, l_sum, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
    cache_ptr, slot_ptr, n, block_size, s_page, qk_scale,
    BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The online softmax state (max, sum, the eight 64-wide accumulators) after the ``n``
    slots at ``slot_ptr`` of one cache."""
    for k0 in range(0, n, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        slots = tl.load(slot_ptr + ks, mask=ks < n, other=-1).to(tl.int64)
        valid = slots >= 0
        slots = tl.where(valid, slots, 0)
        page = cache_ptr + (slots // block_size) * s_page
        data = page + (slots % block_size) * _DATA
        scales = page + block_size * _DATA + (slots % block_size) * _SCALES

        s = _qk(q_rows, hmask, data, scales, valid, 0, INTERPRET)
        s += _qk(q_rows, hmask, data, scales, valid, 1, INTERPRET)
        s += _qk(q_rows, hmask, data, scales, valid, 2, INTERPRET)
        s += _qk(q_rows, hmask, data, scales, valid, 3, INTERPRET)
        s += _qk(q_rows, hmask, data, scales, valid, 4, INTERPRET)
        s += _qk(q_rows, hmask, data, scales, valid, 5, INTERPRET)
        s += _qk(q_rows, hmask, data, scales, valid, 6, INTERPRET)
        s += _qk(q_rows, hmask, data, scales, valid, 7, INTERPRET)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        m = m_new
        acc0 = _pv(acc0, alpha, p, data, scales, valid, 0, INTERPRET)
        acc1 = _pv(acc1, alpha, p, data, scales, valid, 1, INTERPRET)
        acc2 = _pv(acc2, alpha, p, data, scales, valid, 2, INTERPRET)
        acc3 = _pv(acc3, alpha, p, data, scales, valid, 3, INTERPRET)
        acc4 = _pv(acc4, alpha, p, data, scales, valid, 4, INTERPRET)
        acc5 = _pv(acc5, alpha, p, data, scales, valid, 5, INTERPRET)
        acc6 = _pv(acc6, alpha, p, data, scales, valid, 6, INTERPRET)
        acc7 = _pv(acc7, alpha, p, data, scales, valid, 7, INTERPRET)
    return m, l_sum, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.jit
def _store_piece(out_rows, hmask, acc, inv_l, PIECE: tl.constexpr, INTERPRET: tl.constexpr):
    out = acc * inv_l[:, None]
    if INTERPRET and out_rows.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16(out)
    tl.store(out_rows + PIECE * _QBLOCK, out.to(out_rows.dtype.element_ty), mask=hmask[:, None])


@triton.jit(do_not_specialize=["n_window", "n_comp", "T"])
def _dsv4_attend_kernel(
    q_ptr,
    window_ptr,
    w_slot_ptr,
    comp_ptr,
    c_slot_ptr,
    sink_ptr,
    out_ptr,
    T,
    H,
    n_window,
    n_comp,
    w_block,
    c_block,
    s_w_page,
    s_c_page,
    s_qt,
    s_qh,
    s_wt,
    s_ct,
    s_ot,
    s_oh,
    qk_scale,  # softmax scale * log2(e)
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    c = tl.arange(0, _QBLOCK)
    q_rows = q_ptr + t * s_qt + heads[:, None] * s_qh + c[None, :]

    # The sink opens the softmax: m = sink, l = 1 (2**(sink - m)); -inf (no sink) or a
    # padded head: a finite floor and l = 0, so nothing is -inf - -inf.
    sink = tl.load(sink_ptr + heads, mask=hmask, other=float("-inf")) * _LOG2E
    has_sink = sink > -1e30
    m = tl.where(has_sink, sink, -1e30)
    l_sum = tl.where(has_sink, 1.0, 0.0)
    acc0 = tl.zeros((BLOCK_H, _QBLOCK), tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    m, l_sum, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _attend_source(
        q_rows, hmask, m, l_sum, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
        window_ptr, w_slot_ptr + t * s_wt, n_window, w_block, s_w_page, qk_scale,
        BLOCK_K, INTERPRET,
    )  # fmt: skip
    m, l_sum, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _attend_source(
        q_rows, hmask, m, l_sum, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
        comp_ptr, c_slot_ptr + t * s_ct, n_comp, c_block, s_c_page, qk_scale,
        BLOCK_K, INTERPRET,
    )  # fmt: skip
    inv_l = 1.0 / tl.where(l_sum > 0, l_sum, 1.0)
    out_rows = out_ptr + t * s_ot + heads[:, None] * s_oh + c[None, :]
    _store_piece(out_rows, hmask, acc0, inv_l, 0, INTERPRET)
    _store_piece(out_rows, hmask, acc1, inv_l, 1, INTERPRET)
    _store_piece(out_rows, hmask, acc2, inv_l, 2, INTERPRET)
    _store_piece(out_rows, hmask, acc3, inv_l, 3, INTERPRET)
    _store_piece(out_rows, hmask, acc4, inv_l, 4, INTERPRET)
    _store_piece(out_rows, hmask, acc5, inv_l, 5, INTERPRET)
    _store_piece(out_rows, hmask, acc6, inv_l, 6, INTERPRET)
    _store_piece(out_rows, hmask, acc7, inv_l, 7, INTERPRET)


@triton.jit
def _dsv4_compress_kernel(
    state_ptr,
    gather_ptr,
    pos_ptr,
    weight_ptr,
    cos_sin_ptr,
    out_ptr,
    state_block,
    s_page,
    s_row,
    s_gather,
    s_cs,
    s_out,
    eps,
    RATIO: tl.constexpr,
    WINDOW: tl.constexpr,  # RATIO * coff: the rows a window's softmax spans
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, WINDOW)
    slots = tl.load(gather_ptr + t * s_gather + w).to(tl.int64)
    valid = slots >= 0
    slots = tl.where(valid, slots, 0)
    rows = state_ptr + (slots // state_block) * s_page + (slots % state_block) * s_row
    # C4: the previous window's rows give their first half, the current one's the second
    half = tl.where(w >= RATIO, D, 0) if WINDOW > RATIO else w * 0
    state = WINDOW // RATIO * D  # the kv part's width; the scores follow it
    out_row = out_ptr + t * s_out
    squares = tl.zeros((BLOCK_D,), tl.float32)
    for d0 in tl.static_range(0, D, BLOCK_D):
        ch = d0 + tl.arange(0, BLOCK_D)
        at = rows[:, None] + half[:, None] + ch[None, :]
        kv = tl.load(at, mask=valid[:, None], other=0.0).to(tl.float32)
        score = tl.load(at + state, mask=valid[:, None], other=float("-inf")).to(tl.float32)
        e = tl.exp(score - tl.max(score, axis=0)[None, :])
        entry = tl.sum(e * kv, axis=0) / tl.sum(e, axis=0)
        squares += entry * entry
        tl.store(out_row + ch, entry)
    tl.debug_barrier()  # the entry is read back by other threads of this program
    inv = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / D + eps)
    for d0 in tl.static_range(0, D - _ROPE, BLOCK_D):
        ch = d0 + tl.arange(0, BLOCK_D)
        keep = ch < D - _ROPE
        x = tl.load(out_row + ch, mask=keep)
        tl.store(out_row + ch, x * inv * tl.load(weight_ptr + ch, mask=keep), mask=keep)
    # RoPE at the window's first position: pair i = (2i, 2i + 1) of the last 64 values
    start = tl.load(pos_ptr + t).to(tl.int64) // RATIO * RATIO
    i = tl.arange(0, _ROPE // 2)
    cos = tl.load(cos_sin_ptr + start * s_cs + i)
    sin = tl.load(cos_sin_ptr + start * s_cs + _ROPE // 2 + i)
    even_at = D - _ROPE + 2 * i
    even = tl.load(out_row + even_at) * inv * tl.load(weight_ptr + even_at)
    odd = tl.load(out_row + even_at + 1) * inv * tl.load(weight_ptr + even_at + 1)
    tl.debug_barrier()
    tl.store(out_row + even_at, even * cos - odd * sin)
    tl.store(out_row + even_at + 1, even * sin + odd * cos)


def launch_compress(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    ratio: int,
    out: torch.Tensor,
) -> None:
    """``out`` (``[T, D]`` fp32, contiguous rows) = ``compressor.entries``' rows."""
    tokens, window = gather_slots.shape
    width = weight.numel()
    if window & (window - 1) or width % COMPRESS_BLOCK_D or width <= ROPE:
        raise ValueError(
            f"the Triton compressor takes a power-of-two window and a norm of a multiple of "
            f"{COMPRESS_BLOCK_D} values past the {ROPE} RoPE ones (V4's: 8 or 128 rows, 512 "
            f"or 128 wide), got a window of {window} and {width}"
        )
    if tokens == 0:
        return
    _dsv4_compress_kernel[(tokens,)](
        state_cache,
        gather_slots,
        positions,
        weight,
        cos_sin,
        out,
        state_cache.shape[1],
        state_cache.stride(0),
        state_cache.stride(1),
        gather_slots.stride(0),
        cos_sin.stride(0),
        out.stride(0),
        eps,
        RATIO=ratio,
        WINDOW=window,
        D=width,
        BLOCK_D=COMPRESS_BLOCK_D,
        num_warps=COMPRESS_WARPS,
    )


def _page_stride(cache: torch.Tensor) -> int:
    """Bytes from one page to the next of a paged cache ``dispatch`` checked (each page
    ``block_size * 584`` contiguous bytes)."""
    return cache.view(cache.shape[0], -1).stride(0)


def launch_write(
    cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    cpu_rule: bool,
) -> None:
    """Write ``rows`` (``[T, 512]``, last dim contiguous) at ``slots`` (``[T]``). Exact on
    its bits: the same code runs in the interpreter."""
    if slots.shape[0] == 0:
        return
    _dsv4_write_kernel[(slots.shape[0],)](
        rows,
        slots,
        cache,
        rows.stride(0),
        _page_stride(cache),
        block_size,
        CPU_RULE=cpu_rule,
        num_warps=WRITE_WARPS,
    )


def launch_attend(
    q: torch.Tensor,
    window_cache: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache: torch.Tensor | None,
    compressed_slots: torch.Tensor | None,
    compressed_block_size: int,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    interpret: bool,
) -> None:
    """``out`` (``[T, H, 512]``) of ``attention.attend``'s contract; slot rows contiguous."""
    tokens, heads, _ = q.shape
    if tokens == 0:
        return
    if compressed_slots is None or compressed_slots.numel() == 0:
        compressed_cache, compressed_slots = window_cache, window_slots[:, :0]
        compressed_block_size = window_block_size
    bh = block_h(heads)
    _dsv4_attend_kernel[(tokens, triton.cdiv(heads, bh))](
        q,
        window_cache,
        window_slots,
        compressed_cache,
        compressed_slots,
        sink,
        out,
        tokens,
        heads,
        window_slots.shape[1],
        compressed_slots.shape[1],
        window_block_size,
        compressed_block_size,
        _page_stride(window_cache),
        _page_stride(compressed_cache),
        q.stride(0),
        q.stride(1),
        window_slots.stride(0),
        compressed_slots.stride(0),
        out.stride(0),
        out.stride(1),
        scale * LOG2E,
        BLOCK_H=bh,
        BLOCK_K=BLOCK_K,
        INTERPRET=interpret,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
