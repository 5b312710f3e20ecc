"""Triton bit-level conversions shared by every kernel, exact on any GPU and in the
interpreter (whose own bf16 / fp8 casts round unlike a GPU's).

- ``round_to_bf16``: fp32 -> bf16, round to nearest even on the bits.
- ``e4m3_to_f32``: float8_e4m3fn codes (uint8) -> fp32, exact (no fp8 type: SM80 too).
- ``f32_to_e4m3``: fp32 -> float8_e4m3fn code as torch casts (round to nearest even),
  saturating at +-448 (``formats.E4M3_MAX``), for |x| <= 464.
- ``dot``: ``tl.dot`` of bf16 operands with fp32 accumulation; under the interpreter
  (``INTERPRET``), whose bf16 dot rounds unlike a GPU's, the same values in fp32.
- ``e2m1_to_f32`` / ``f32_to_e2m1``: OCP FP4 E2M1 codes (0..15, bit 3 the sign) <-> fp32,
  arithmetic on any GPU (no ``cvt.*.e2m1x2``, which only SM100a/SM120a have); encoding
  rounds to nearest with ties to the even code and saturates at 6.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, INTERPRET: tl.constexpr):
    """``a @ b`` as a GPU computes it on bf16 operands (fp32 accumulation)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16 with round-to-nearest-even done on the bits."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def e4m3_to_f32(bits):
    """float8_e4m3fn codes (uint8) -> fp32, exact, on the bits."""
    b = bits.to(tl.int32)
    mag = b & 0x7F
    # Normal: exponent e (bias 7) -> e + 120 (bias 127), mantissa shifted up 20 bits.
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    sub = (mag & 7).to(tl.float32) * 0.001953125  # subnormal: m * 2**-9
    val = tl.where(mag >= 8, normal, sub)
    val = tl.where(mag == 0x7F, float("nan"), val)
    return tl.where((b & 0x80) != 0, -val, val)


@triton.jit
def f32_to_e4m3(x):
    """fp32 -> float8_e4m3fn code (uint8), round to nearest even, saturating at +-448."""
    sign = (x.to(tl.uint32, bitcast=True) >> 31).to(tl.int32) << 7
    a = tl.abs(x)
    # Below 2**-6 the grid is uniform (step 2**-9): adding 2**23 rounds to an integer,
    # half to even, as every IEEE fp32 addition does.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    bits = a.to(tl.uint32, bitcast=True)
    # Keep 3 mantissa bits with RNE, then rebias the exponent from 127 to 7.
    rounded = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20).to(tl.int32) - (120 << 3)
    code = tl.where(a < 0.015625, sub, tl.minimum(rounded, 0x7E))
    return (sign | code).to(tl.uint8)


@triton.jit
def e2m1_to_f32(code):
    """e2m1 codes (int, 0..15) -> fp32, exact: 0, 0.5, 1, 1.5, 2, 3, 4, 6 with bit 3 the sign."""
    c = code.to(tl.int32)
    mag = c & 7
    # codes 2..7 are normal: exponent mag >> 1 (bias 1), one mantissa bit mag & 1
    normal = ((((mag >> 1) + 126) << 23) | ((mag & 1) << 22)).to(tl.float32, bitcast=True)
    val = tl.where(mag >= 2, normal, mag.to(tl.float32) * 0.5)
    return tl.where((c & 8) != 0, -val, val)


@triton.jit
def f32_to_e2m1(x):
    """fp32 -> e2m1 code (int32, 0..15): nearest, ties to the even code, saturating at 6,
    the sign bit kept. Each binade's grid is uniform, so the code is an integer rounding
    there; adding 2**23 rounds a small non-negative fp32 to an integer, half to even."""
    sign = (x.to(tl.uint32, bitcast=True) >> 31).to(tl.int32) << 3
    a = tl.minimum(tl.abs(x), 8.0)  # past 7 everything saturates to 6 (code 7)
    low = ((a * 2.0 + 8388608.0) - 8388608.0).to(tl.int32)  # [0, 2): step 0.5, codes 0..4
    mid = ((a + 8388608.0) - 8388608.0).to(tl.int32) + 2  # [2, 4): step 1, codes 4..6
    high = tl.minimum(((a * 0.5 + 8388608.0) - 8388608.0).to(tl.int32), 3) + 4  # step 2: 6, 7
    return sign | tl.where(a < 2.0, low, tl.where(a < 4.0, mid, high))
