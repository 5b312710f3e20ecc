"""Triton bit-level conversions shared by every kernel, exact on any GPU and in the
interpreter (whose own bf16 / fp8 casts round unlike a GPU's).

- ``round_to_bf16``: fp32 -> bf16, round to nearest even on the bits.
- ``e4m3_to_f32``: float8_e4m3fn codes (uint8) -> fp32, exact (no fp8 type: SM80 too).
- ``f32_to_e4m3``: fp32 -> float8_e4m3fn code as torch casts (round to nearest even),
  saturating at +-448 (``formats.E4M3_MAX``), for |x| <= 464.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
