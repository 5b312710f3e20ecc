"""Triton DSA lightning indexer for CUDA SM80+: key insert, paged logits, top-k.

Same numeric contract as ``reference`` (its module docstring), checked against it:

- ``insert_keys``: bit-exact e4m3 bytes and float32 scales. The e4m3 encode and the
  ue8m0 rounding are done on the bits (like torch's cast and the reference's fp32 log2),
  so no fp8 type is needed (SM80).
- ``paged_logits``: fp32 results within ``LOGIT_RTOL`` (below) of the reference; only the
  order of the fp32 sums differs.
- ``select_topk``: identical to ``reference.select_topk`` (plain torch, exact tie rule).
- ``index_topk``: identical to ``reference.index_topk`` except where two logits lie
  within the logit tolerance of each other at a place the order depends on.

Every op is a torch custom op (``vllm_mla::indexer_insert_keys``, ``_paged_logits``,
``_select_topk``; fake impls registered; ``index_topk`` is the last two in a row) with
grids and temporaries fixed by shapes and no host sync, so it can be captured in a CUDA
graph. On CPU the Triton kernels run only under
``TRITON_INTERPRET=1``; there ``INTERPRET`` makes the dots fp32 (the interpreter's bf16
dot is wrong: it rounds unlike a GPU's). GPU code never takes those branches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mla import envs
from vllm_mla.ops.sparse_indexer.reference import (
    AMAX_FLOOR,
    E4M3_MAX,
    INDEX_HEAD_DIM,
    IndexerError,
    _check_cache,
)
from vllm_mla.ops.triton.bits import e4m3_to_f32, f32_to_e4m3

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


# ---------------------------------------------------------------- host side


def _expect(name: str, ok: bool, expected: str, got: object) -> None:
    if not ok:
        raise IndexerError(f"{name}: expected {expected}, got {got}")


def _check_runnable(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for x in tensors[1:]:
        _expect("device", x.device == device, f"every tensor on {device}", x.device)
    if device.type == "cpu" and envs.triton_interpret():
        return
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0):
        return
    raise NotImplementedError(
        f"the Triton indexer needs a CUDA device of SM80 or later (or TRITON_INTERPRET=1 for "
        f"CPU tensors); got device {device}: use vllm_mla.ops.sparse_indexer.reference there"
    )


def _check_pages(cache: torch.Tensor) -> None:
    _check_cache(cache)
    # The scales are read and written as float32 at page + block_size * 128 + 4 * slot.
    aligned = cache.data_ptr() % 4 == 0 and cache.stride(0) % 4 == 0
    _expect("index-key cache", aligned, "4-byte aligned pages", (cache.data_ptr(), cache.stride()))


def _block_h(num_heads: int) -> int:
    """Heads per dot: tl.dot needs >= 16 rows; more than MAX_BLOCK_H loop."""
    return min(MAX_BLOCK_H, max(16, triton.next_power_of_2(num_heads)))


def insert_keys(
    cache: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, *, ue8m0: bool = True
) -> None:
    """Quantize ``k [T, 128]`` (bf16/fp16/fp32) row-wise and write row ``t`` at physical
    slot ``slots[t]`` (int32/int64); bytes and scales bit-identical to
    ``reference.insert_keys``. Slots < 0 or past the pool are skipped."""
    torch.ops.vllm_mla.indexer_insert_keys(cache, k, slots, ue8m0)


@torch.library.custom_op("vllm_mla::indexer_insert_keys", mutates_args=("cache",))
def _insert_keys_op(cache: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, ue8m0: bool) -> None:
    _check_pages(cache)
    floats = (torch.bfloat16, torch.float16, torch.float32)
    _expect("k", k.dtype in floats, f"dtype in {floats}", k.dtype)
    _expect("slots", slots.dtype in (torch.int32, torch.int64), "int32 or int64", slots.dtype)
    _expect("slots", slots.dim() == 1 and slots.stride(0) == 1, "a contiguous [T]", slots.shape)
    t = slots.shape[0]
    _expect("k", k.shape == (t, INDEX_HEAD_DIM), f"shape ({t}, {INDEX_HEAD_DIM})", tuple(k.shape))
    _check_runnable(cache, k, slots)
    if t == 0:
        return
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


@_insert_keys_op.register_fake
def _(cache, k, slots, ue8m0):
    return None


def paged_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[T, S]`` logits of each token against its request's keys, within
    ``LOGIT_RTOL`` of ``reference.logits``; ``-inf`` at positions >= ``lengths[t]``.

    ``q [T, H, 128]`` float8_e4m3fn or bf16, ``weights [T, H]`` fp32, ``block_tables
    [T, W]`` int32 (the block-table row of each token's request), ``lengths [T]`` int32.
    ``S`` is ``out.shape[1]`` or ``max_len``: positions >= S are not computed (a length
    past S is cut to S), nor are positions past the block table or on a table entry
    outside the pool (``-inf``). No host sync; shapes fix the grid (CUDA graphs).
    """
    if out is None:
        _expect("max_len", max_len is not None and max_len >= 0, "an int >= 0 (or out)", max_len)
        out = torch.empty(q.shape[0], max_len, dtype=torch.float32, device=q.device)
    elif max_len is not None:
        _expect("out", out.dim() == 2 and out.shape[1] == max_len, f"[T, {max_len}]", out.shape)
    torch.ops.vllm_mla.indexer_paged_logits(q, weights, cache, block_tables, lengths, out)
    return out


@torch.library.custom_op("vllm_mla::indexer_paged_logits", mutates_args=("out",))
def _paged_logits_op(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
) -> None:
    _check_pages(cache)
    q_dtypes = (torch.float8_e4m3fn, torch.bfloat16)
    _expect("q", q.dtype in q_dtypes, f"dtype in {q_dtypes}", q.dtype)
    shape_ok = q.dim() == 3 and q.shape[-1] == INDEX_HEAD_DIM and q.stride(-1) == 1
    _expect("q", shape_ok, f"[T, H, {INDEX_HEAD_DIM}] with unit last stride", tuple(q.shape))
    t, h, _ = q.shape
    s = out.shape[-1] if out.dim() == 2 else -1
    for name, x, dtype, shape in (
        ("weights", weights, torch.float32, (t, h)),
        ("lengths", lengths, torch.int32, (t,)),
        ("out", out, torch.float32, (t, s)),
    ):
        _expect(name, x.dtype == dtype, f"dtype {dtype}", x.dtype)
        _expect(name, tuple(x.shape) == shape and x.stride(-1) == 1, f"contiguous {shape}", x.shape)
    _expect("block_tables", block_tables.dtype == torch.int32, "dtype int32", block_tables.dtype)
    bt_ok = block_tables.dim() == 2 and block_tables.shape[0] == t and block_tables.stride(1) == 1
    _expect("block_tables", bt_ok, f"contiguous [T={t}, W]", tuple(block_tables.shape))
    _check_runnable(q, weights, cache, block_tables, lengths, out)
    if t == 0 or s == 0:
        return
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


@_paged_logits_op.register_fake
def _(q, weights, cache, block_tables, lengths, out):
    return None


def select_topk(
    scores: torch.Tensor, lengths: torch.Tensor, topk: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """int32 ``[T, topk]``, identical to ``reference.select_topk``: per row the ``topk``
    largest of ``scores[t, :lengths[t]]``, ties toward the lower position, descending,
    ``-1`` past ``min(topk, lengths[t], S)`` (``topk`` may exceed ``S``).

    Plain torch, batched, no host sync (portable and CUDA-graph capturable): one int64
    key per score, ``order-preserving int32 of the score << 32 | (S - 1 - position)``,
    so ``torch.topk`` on distinct keys applies the tie rule exactly. Temporary memory:
    ~3 int64 ``[T, S]`` tensors.
    """
    _expect("topk", isinstance(topk, int) and topk >= 1, "an int >= 1", topk)
    if out is None:
        out = torch.empty(scores.shape[0], topk, dtype=torch.int32, device=scores.device)
    _expect("out", out.dim() == 2 and out.shape[-1] == topk, f"[T, {topk}]", tuple(out.shape))
    torch.ops.vllm_mla.indexer_select_topk(scores, lengths, out)
    return out


@torch.library.custom_op("vllm_mla::indexer_select_topk", mutates_args=("out",))
def _select_topk_op(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
    ok = scores.dim() == 2 and scores.is_floating_point()
    _expect("scores", ok, "floating [T, S]", (scores.dtype, tuple(scores.shape)))
    t, s = scores.shape
    int_ok = lengths.dtype in (torch.int32, torch.int64) and tuple(lengths.shape) == (t,)
    _expect("lengths", int_ok, f"int32/int64 shape ({t},)", (lengths.dtype, tuple(lengths.shape)))
    out_ok = out.dtype == torch.int32 and out.dim() == 2 and out.shape[0] == t
    _expect("out", out_ok, f"int32 [T={t}, topk]", (out.dtype, tuple(out.shape)))
    _expect("device", lengths.device == out.device == scores.device, scores.device, out.device)
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


@_select_topk_op.register_fake
def _(scores, lengths, out):
    return None


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    *,
    max_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 ``[T, topk]`` request-local positions, the result contract of
    ``reference.index_topk`` (for ``max_len >= max(lengths)``): ``paged_logits`` into an
    fp32 ``[T, max_len]`` buffer, then ``select_topk``. Two custom ops, no host sync."""
    scores = paged_logits(q, weights, cache, block_tables, lengths, max_len=max_len)
    return select_topk(scores, lengths, topk, out=out)
