"""Triton kernel: fused MLA query projection, ``out = [bf16(q_nope @ W) | q_pe]`` (+ FP8).

One program per (head, column tile). Tiles ``0 .. L/BLOCK_L - 1`` compute
``q_nope[:, h, :] @ W[h]`` with fp32 accumulation, round to BF16 and store the
latent part; the last tile copies ``q_pe[:, h, :]``. With FP8 output every value
(latent and rope) becomes ``e4m3(clamp(bf16_value / q_scale, -448, 448))``.

The ``INTERPRET`` constexpr is on only under Triton's CPU interpreter, whose
bf16 ``tl.dot`` and fp32 -> bf16 / fp8 casts are wrong (they round unlike a GPU's);
it swaps in exact fp32 dots and bit-level round-to-nearest-even. GPU code never
takes those branches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_mla import envs
from vllm_mla.formats import E4M3_MAX
from vllm_mla.ops.base import MXFP8Weight
from vllm_mla.ops.capture import check_compiled, record_compiled
from vllm_mla.ops.triton_bits import f32_to_e4m3, round_to_bf16

_E4M3_MAX = tl.constexpr(E4M3_MAX)


@triton.jit
def _to_output(val, q_scale, FP8_OUT: tl.constexpr, INTERPRET: tl.constexpr):
    """bf16 values -> the output dtype (bf16, or e4m3 of value / q_scale)."""
    if FP8_OUT:
        x = tl.math.div_rn(val.to(tl.float32), q_scale)
        if INTERPRET:
            return f32_to_e4m3(x).to(tl.float8e4nv, bitcast=True)  # saturates to +-448
        # Saturate explicitly: overflow behaviour of the cast is not Triton's contract.
        x = tl.minimum(tl.maximum(x, -_E4M3_MAX), _E4M3_MAX)
        return x.to(tl.float8e4nv)
    else:  # not a bare `return val`: Triton 3.6 types it too ("Inconsistent return types")
        return val


@triton.jit(do_not_specialize=["M", "s_qm", "s_qh", "s_wh", "s_wk", "s_sh", "s_sk"])
def mla_query_projection_kernel(
    q_ptr,
    w_ptr,
    s_ptr,
    pe_ptr,
    out_ptr,
    q_scale_ptr,
    M,
    s_qm,
    s_qh,
    s_wh,
    s_wk,
    s_sh,
    s_sk,
    s_pm,
    s_ph,
    s_om,
    s_oh,
    P: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
    MXFP8: tl.constexpr,
    FP8_OUT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    h = tl.program_id(0)
    tile = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows[:, None] < M
    q_scale = tl.load(q_scale_ptr) if FP8_OUT else 1.0

    if tile * BLOCK_L < L:
        cols = tile * BLOCK_L + tl.arange(0, BLOCK_L)
        acc = tl.zeros((BLOCK_M, BLOCK_L), dtype=tl.float32)
        for k0 in tl.static_range(0, P, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            q = tl.load(
                q_ptr + rows[:, None] * s_qm + h * s_qh + ks[None, :], mask=row_ok, other=0.0
            )
            w_offs = h * s_wh + ks[:, None] * s_wk + cols[None, :]
            w = tl.load(w_ptr + w_offs)
            if MXFP8:
                # E8M0 -> fp32 from the bits: exact, 0 -> 2**-127 (subnormal), 255 -> NaN.
                code = tl.load(s_ptr + h * s_sh + ks[:, None] * s_sk + (cols // 32)[None, :])
                code = code.to(tl.int32)
                bits = tl.where(code == 0, 0x00400000, code << 23)
                bits = tl.where(code == 255, 0x7FC00000, bits)
                # e4m3 x 2**k fits bf16 exactly, as the staged path's dequant does.
                w = (w.to(tl.float32) * bits.to(tl.float32, bitcast=True)).to(tl.bfloat16)
            if INTERPRET:
                acc += tl.dot(q.to(tl.float32), w.to(tl.float32))
            else:
                acc += tl.dot(q, w)
        val = round_to_bf16(acc) if INTERPRET else acc.to(tl.bfloat16)
        out = _to_output(val, q_scale, FP8_OUT, INTERPRET)
        tl.store(out_ptr + rows[:, None] * s_om + h * s_oh + cols[None, :], out, mask=row_ok)
    else:
        cols = tl.arange(0, R)
        pe = tl.load(pe_ptr + rows[:, None] * s_pm + h * s_ph + cols[None, :], mask=row_ok)
        out = _to_output(pe, q_scale, FP8_OUT, INTERPRET)
        tl.store(out_ptr + rows[:, None] * s_om + h * s_oh + L + cols[None, :], out, mask=row_ok)


BLOCK_K = 64


def tiles(m: int, latent: int, interpret: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_L): tl.dot needs >= 16 rows; the interpreter prefers few programs."""
    block_m = max(16, triton.next_power_of_2(m))
    block_l = latent if interpret else 64
    return block_m, block_l


def launch(args, q_nope, q_pe, out, q_scale) -> None:
    """Launch the kernel on validated, gated arguments (``api.Args``; ``dispatch`` gates)."""
    interpret = envs.triton_interpret()
    block_m, block_l = tiles(args.m, args.latent, interpret)
    mx = isinstance(args.weight, MXFP8Weight)
    values = args.weight.values if mx else args.weight
    scales = args.weight.scales if mx else values  # unused when not MXFP8
    scale = q_scale if args.fp8_out else q_nope  # unused without FP8 output
    pointers = (q_nope, values, scales, q_pe, out, scale)
    key = (
        q_nope.device,
        out.dtype,
        mx,
        args.p,
        block_m,
        tuple(t.data_ptr() % 16 == 0 for t in pointers),
    )
    check_compiled(
        key,
        q_nope.device,
        f"fused query projection variant (M bucket {block_m}, P={args.p}, "
        f"{'mxfp8' if mx else 'bf16'} weight, out {out.dtype})",
    )
    grid = (args.h, args.latent // block_l + 1)
    mla_query_projection_kernel[grid](
        q_nope,
        values,
        scales,
        q_pe,
        out,
        scale,
        args.m,
        q_nope.stride(0),
        q_nope.stride(1),
        values.stride(0),
        values.stride(1),
        scales.stride(0),
        scales.stride(1) if mx else 0,
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        P=args.p,
        L=args.latent,
        R=args.rope,
        BLOCK_M=block_m,
        BLOCK_K=BLOCK_K,
        BLOCK_L=block_l,
        MXFP8=mx,
        FP8_OUT=args.fp8_out,
        INTERPRET=interpret,
        num_warps=4,
    )
    record_compiled(key)
