"""Triton kernel: ``out[b] = a[b] @ W[b]`` with W dense or MXFP8 read in place.

One program per (batch, M tile, N tile). Every operand is addressed through its own
strides, so W may be a transposed view into kv_b_proj's pack (W_UV ``[H, L, V]`` is
rows of ``[H * (P + V), L]`` read column-wise). For MXFP8 each element is decoded
``e4m3 * 2**(code - 127)`` (exact in BF16), with one scale per 32 elements along K
(``SCALE_ALONG_K``, W_UV) or along N (W_UK_T). Accumulation is fp32; the result is
rounded once to ``out``'s dtype.

Under Triton's CPU interpreter (``INTERPRET``) bf16 dots and casts are wrong
(they round unlike a GPU's); that branch uses fp32 dots and bit-level rounding. GPU code
never takes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_mla import envs
from vllm_mla.ops.absorbed_matmul.api import as_uint8
from vllm_mla.ops.capture import check_compiled, record_compiled
from vllm_mla.ops.triton_bits import round_to_bf16


@triton.jit
def _e8m0(code):
    """E8M0 code -> fp32 from the bits: exact; 0 -> 2**-127 (subnormal), 255 -> NaN."""
    code = code.to(tl.int32)
    bits = tl.where(code == 0, 0x00400000, code << 23)
    bits = tl.where(code == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit(
    do_not_specialize=[
        "M",
        "s_ab",
        "s_am",
        "s_ak",
        "s_wb",
        "s_wk",
        "s_wn",
        "s_sb",
        "s_sk",
        "s_sn",
        "s_ob",
        "s_om",
        "s_on",
    ]
)
def absorbed_bmm_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    o_ptr,
    M,
    s_ab,
    s_am,
    s_ak,
    s_wb,
    s_wk,
    s_wn,
    s_sb,
    s_sk,
    s_sn,
    s_ob,
    s_om,
    s_on,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MXFP8: tl.constexpr,
    SCALE_ALONG_K: tl.constexpr,
    FP32_IN: tl.constexpr,
    OUT_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    b = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + b * s_ab + rows[:, None] * s_am + ks[None, :] * s_ak,
            mask=row_ok & k_ok[None, :],
            other=0.0,
        )
        w_mask = k_ok[:, None] & col_ok
        w = tl.load(
            w_ptr + b * s_wb + ks[:, None] * s_wk + cols[None, :] * s_wn, mask=w_mask, other=0.0
        )
        if MXFP8:
            if SCALE_ALONG_K:
                s_offs = (ks // 32)[:, None] * s_sk + cols[None, :] * s_sn
            else:
                s_offs = ks[:, None] * s_sk + (cols // 32)[None, :] * s_sn
            code = tl.load(s_ptr + b * s_sb + s_offs, mask=w_mask, other=127)
            w = w.to(tl.float32) * _e8m0(code)
            if not FP32_IN:
                w = w.to(tl.bfloat16)  # exact: e4m3 x 2**k has at most 4 significant bits
        if INTERPRET or FP32_IN:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if OUT_BF16:
        val = round_to_bf16(acc) if INTERPRET else acc.to(tl.bfloat16)
    else:
        val = acc.to(o_ptr.dtype.element_ty)
    tl.store(
        o_ptr + b * s_ob + rows[:, None] * s_om + cols[None, :] * s_on, val, mask=row_ok & col_ok
    )


def tiles(m: int, n: int, k: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): tl.dot needs >= 16 on every side."""
    if interpret:  # few, large programs: the interpreter's cost is per program
        return max(16, triton.next_power_of_2(min(m, 64))), triton.next_power_of_2(n), 32
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return block_m, 64, 64 if k % 64 == 0 else 32


def launch(a: torch.Tensor, values: torch.Tensor, scales, out: torch.Tensor) -> None:
    """Launch ``out = a @ W`` on validated operands (``api``'s contract).

    ``scales`` is None for a dense W; otherwise its shape says the block axis.
    """
    if out.numel() == 0:
        return  # B, M or N is 0 (no tile to launch; N = 0 would make a 0-wide tile)
    interpret = envs.triton_interpret()
    batch, m, k = a.shape
    n = values.shape[2]
    block_m, block_n, block_k = tiles(m, n, k, interpret)
    mx = scales is not None
    if mx:
        scales = as_uint8(scales)
    along_k = mx and scales.shape[1] != k
    s = scales if mx else values  # unused when dense
    key = (
        "absorbed_bmm",
        a.device,
        a.dtype,
        values.dtype,
        out.dtype,
        mx,
        along_k,
        n,
        k,
        block_m,
        tuple(t.data_ptr() % 16 == 0 for t in (a, values, s, out)),
    )
    check_compiled(key, a.device, f"absorbed bmm variant (M bucket {block_m}, K={k}, N={n})")
    grid = (batch, triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    absorbed_bmm_kernel[grid](
        a,
        values,
        s,
        out,
        m,
        *a.stride(),
        *values.stride(),
        *(s.stride() if mx else (0, 0, 0)),
        *out.stride(),
        N=n,
        K=k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        MXFP8=mx,
        SCALE_ALONG_K=along_k,
        FP32_IN=a.dtype == torch.float32,
        OUT_BF16=out.dtype == torch.bfloat16,
        INTERPRET=interpret,
        num_warps=4,
    )
    record_compiled(key)
