"""MXFP8 (E4M3 elements, E8M0 shared scales) codec, bit-exact.

Format per the OCP Microscaling Formats (MX) Specification v1.0 (MXFP8, E4M3): each block of
``BLOCK_SIZE`` consecutive elements along one axis shares an E8M0 scale, stored here as its
biased exponent (uint8, value ``2 ** (biased - 127)``, 255 meaning NaN), and every element is a
float8_e4m3fn code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from vllm_mla.formats import (
    E4M3_EMAX,
    E4M3_MAX,
    E4M3_NAN_CODE,
    E8M0_BIAS,
    E8M0_MAX,
    E8M0_NAN,
    MX_BLOCK,
)

BLOCK_SIZE = MX_BLOCK  # elements sharing one scale
SCALE_BIAS, SCALE_NAN, SCALE_MAX = E8M0_BIAS, E8M0_NAN, E8M0_MAX
FP32_MIN_NORMAL = 2.0**-126  # smallest normal float32
SUBNORMAL_SHIFT = 64  # scaling a float32 subnormal by 2**64 makes it normal, exactly

ScaleMode = Literal["floor", "rceil"]
SCALE_MODES: tuple[str, ...] = ("floor", "rceil")
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

# _POW2[b] == 2 ** (b - 127) exactly for b in 0..254 (2**-127 is a float32 subnormal, still
# exact); _POW2[255] is NaN, so indexing by a scale code decodes E8M0 including its NaN.
_POW2 = torch.tensor(
    [math.ldexp(1.0, b - SCALE_BIAS) for b in range(SCALE_MAX + 1)] + [math.nan],
    dtype=torch.float32,
)


@dataclass(frozen=True)
class MXFP8Tensor:
    """MXFP8 data: ``values`` (float8_e4m3fn, the original shape) and ``scales`` (uint8 biased
    exponents, the original shape with ``size(axis) // BLOCK_SIZE`` on ``axis``), on one
    device."""

    values: torch.Tensor
    scales: torch.Tensor
    axis: int

    def __post_init__(self) -> None:
        if self.values.dtype != torch.float8_e4m3fn:
            raise TypeError(f"values: expected torch.float8_e4m3fn, got {self.values.dtype}")
        if self.scales.dtype != torch.uint8:
            raise TypeError(f"scales: expected torch.uint8, got {self.scales.dtype}")
        if self.scales.device != self.values.device:
            raise ValueError(
                f"scales: expected device {self.values.device} (values'), got {self.scales.device}"
            )
        shape = tuple(self.values.shape)
        if not 0 <= self.axis < len(shape):
            raise ValueError(f"axis must be in [0, {len(shape)}) for values of shape {shape}")
        if shape[self.axis] % BLOCK_SIZE:
            raise ValueError(
                f"values shape {shape}: size {shape[self.axis]} on axis {self.axis} "
                f"is not a multiple of {BLOCK_SIZE}"
            )
        expected = _scale_shape(shape, self.axis)
        if tuple(self.scales.shape) != expected:
            raise ValueError(
                f"scales shape: expected {expected} for values of shape {shape} and "
                f"axis {self.axis}, got {tuple(self.scales.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        """Bytes of ``values`` plus ``scales`` as viewed (numel * element_size)."""
        return sum(t.numel() * t.element_size() for t in (self.values, self.scales))

    def narrow(self, dim: int, start: int, length: int) -> MXFP8Tensor:
        """Views of ``values`` and ``scales`` restricted to ``[start, start + length)`` on
        ``dim``, which must not be the block axis (blocks cannot be split)."""
        ndim = self.values.dim()
        if not -ndim <= dim < ndim:
            raise ValueError(f"dim {dim} out of range for shape {tuple(self.shape)}")
        dim %= ndim
        if dim == self.axis:
            raise ValueError(
                f"cannot narrow along the block axis {self.axis} (shape {tuple(self.shape)}); "
                "expected any other dim"
            )
        return MXFP8Tensor(
            self.values.narrow(dim, start, length),
            self.scales.narrow(dim, start, length),
            self.axis,
        )


def quantize(x: torch.Tensor, *, axis: int = -1, scale_mode: ScaleMode = "rceil") -> MXFP8Tensor:
    """Quantize ``x`` (float32/bfloat16/float16) to MXFP8 with blocks of 32 along ``axis``.

    Computed in float32. Per block, with ``amax = max |x|``:

    - ``floor`` (the OCP MX v1.0 conversion algorithm):
      ``biased = clamp(floor(log2(amax)) - 8 + 127, 0, 254)``, where 8 = floor(log2(448));
      elements above 448 after scaling saturate.
    - ``rceil`` (NVIDIA kernels): ``biased = clamp(ceil(log2(fl32(amax / 448))) + 127,
      0, 254)``, the smallest power of two not below the rounded ``amax / 448``.

    Both exponents are read exactly from the float32 bit pattern (subnormals included), never
    via a floating-point log2. ``amax == 0`` gives ``biased = 0``. A block holding NaN or
    +-Inf gets ``biased = 255`` and all of its values NaN; other blocks are unaffected.
    Elements are ``e4m3_rne(clamp(x * 2 ** (127 - biased), -448, 448))``.
    """
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x: expected one of {INPUT_DTYPES}, got {x.dtype}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode: expected one of {SCALE_MODES}, got {scale_mode!r}")
    axis = _normalize_axis(axis, tuple(x.shape))

    blocks = _to_blocks(x.to(torch.float32), axis)
    finite = torch.isfinite(blocks).all(dim=-1)
    amax = blocks.abs().amax(dim=-1)  # NaN/Inf for non-finite blocks; overwritten below

    if scale_mode == "floor":
        exponent = _floor_log2(amax) - E4M3_EMAX
    else:
        s = amax / E4M3_MAX
        exponent = _floor_log2(s) + (~_is_pow2(s)).to(torch.int32)
    # amax == 0 (or s underflowing to 0) reads as exponent -191 - 8 or -191, clamped to 0.
    biased = (exponent + SCALE_BIAS).clamp(0, SCALE_MAX)

    # 2**(127 - biased) is a power of two, so the product is exact unless it drops below the
    # float32 normal range; such elements are < 2**-126, far below half the smallest e4m3
    # subnormal (2**-10), and round to +-0 either way.
    scaled = blocks * _POW2.to(x.device)[(SCALE_MAX - biased).long()].unsqueeze(-1)
    # The explicit clamp keeps saturation independent of the torch version: recent torch
    # casts saturate, older releases turned |x| >= 480 into NaN.
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(finite.unsqueeze(-1), codes, E4M3_NAN_CODE)
    biased = torch.where(finite, biased, SCALE_NAN)

    values = _from_blocks(codes, axis).view(torch.float8_e4m3fn)
    scales = biased.to(torch.uint8).movedim(-1, axis).contiguous()
    return MXFP8Tensor(values, scales, axis)


def dequantize(t: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode to ``dtype``: each element is ``float32(value) * 2 ** (biased - 127)``; a block
    with ``biased == 255`` is all NaN.

    The float32 product is exact: an e4m3 value has at most 4 significant bits and its lowest
    set bit is >= 2**-9, so scaled by 2**-127 it still lands on the float32 subnormal grid
    (2**-149). The one exception is overflow to +-inf when the product reaches 2**128. Data
    quantized from float32 hits it only in ``rceil`` mode, for elements with
    ``|x| >= 248 * 2**120`` (about 3.3e38): biased 247, and ``x / 2**120 >= 248`` rounds to 256.
    The float32 result is then cast to ``dtype`` (round to nearest even).
    """
    blocks = _to_blocks(t.values, t.axis).to(torch.float32)
    scale = decode_scales(t.scales.movedim(t.axis, -1))
    # In place: one float32 buffer per element is all the scratch a caller pays for.
    blocks.mul_(scale.unsqueeze(-1))
    return _from_blocks(blocks, t.axis).to(dtype)


def decode_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes (uint8) to their float32 values ``2 ** (code - 127)``, exactly; 255 -> NaN."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"scales: expected torch.uint8, got {scales.dtype}")
    return _POW2.to(scales.device)[scales.long()]


def count_nan_blocks(scales: torch.Tensor) -> int:
    """Number of scale entries equal to ``SCALE_NAN`` (255), i.e. poisoned blocks."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"scales: expected torch.uint8, got {scales.dtype}")
    return int((scales == SCALE_NAN).sum().item())


def _normalize_axis(axis: int, shape: tuple[int, ...]) -> int:
    ndim = len(shape)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for shape {shape}; expected [-{ndim}, {ndim})")
    axis %= ndim
    if shape[axis] % BLOCK_SIZE:
        raise ValueError(
            f"shape {shape}: size {shape[axis]} on axis {axis} is not a multiple of {BLOCK_SIZE}"
        )
    return axis


def _scale_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return (*shape[:axis], shape[axis] // BLOCK_SIZE, *shape[axis + 1 :])


def _to_blocks(x: torch.Tensor, axis: int) -> torch.Tensor:
    """``x`` with ``axis`` moved last and split into ``(..., n // 32, 32)``."""
    moved = x.movedim(axis, -1)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)


def _from_blocks(blocks: torch.Tensor, axis: int) -> torch.Tensor:
    """Inverse of ``_to_blocks``, contiguous."""
    merged = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK_SIZE)
    return merged.movedim(-1, axis).contiguous()


def _normalized_bits(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For non-negative finite float32 ``a``: its bit pattern after scaling subnormals by
    2**64 (exact), and the amount (0 or 64) to subtract from the decoded exponent."""
    subnormal = a < FP32_MIN_NORMAL
    normal = torch.where(subnormal, a * 2.0**SUBNORMAL_SHIFT, a)
    return normal.view(torch.int32), subnormal.to(torch.int32) * SUBNORMAL_SHIFT


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """Exact ``floor(log2(a))`` (int32) for positive finite float32 ``a``; 0 maps to -191."""
    bits, shift = _normalized_bits(a)
    return ((bits >> 23) & 0xFF) - SCALE_BIAS - shift


def _is_pow2(a: torch.Tensor) -> torch.Tensor:
    """Whether positive finite float32 ``a`` is an exact power of two (mantissa bits zero)."""
    bits, _ = _normalized_bits(a)
    return (bits & 0x7FFFFF) == 0
