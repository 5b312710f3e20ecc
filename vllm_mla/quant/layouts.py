"""Scale layouts vLLM's linear kernels leave on a layer after their own post-load.

Each layout has a ``pack_*`` (a model of what the kernel's post-load writes, used by
``vllm-mla qualify`` and the tests) and an ``unpack_*`` (what the lifecycle reads).
Both are plain torch and run on CPU; the vLLM tests check every ``pack_*`` against
vLLM's own function where that function runs on CPU.

- **128x4 swizzle** (FlashInfer CUTLASS / CuTe-DSL MXFP8, ``torch._scaled_mm``; vLLM's
  ``swizzle_mxfp8_scale``): a ``[M, S]`` grid of E8M0 scales (S = K / 32) becomes one
  flat array of ``ceil(M / 128) * 128 * ceil(S / 4) * 4`` bytes; scale ``(m, s)`` lives at
  ``mt * (ns * 512) + st * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + s % 4`` with
  ``mt = m // 128``, ``st = s // 4``, ``ns = ceil(S / 4)``. Padding is zero.
- **Packed UE8M0 rows** (DeepGEMM on SM100/SM120 with ``VLLM_USE_DEEP_GEMM_E8M0``,
  ``transform_sf_into_required_layout``): block-FP8 scales that are powers of two,
  broadcast to one row per output row, their float32 exponent bytes packed four
  k-blocks to an int32 (little-endian: byte ``j`` of word ``p`` is k-block ``4p + j``),
  shape ``[N, ceil(kb / 4)]``, MN-major with strides ``(1, align(N, 4))``; unused bytes 0.
"""

from __future__ import annotations

import torch

SWIZZLE_ROWS = 128  # rows per 128x4 tile
SWIZZLE_COLS = 4  # scales per 128x4 tile row
UE8M0_PER_WORD = 4  # exponent bytes per int32 in DeepGEMM's packed layout
TMA_ALIGN = 4  # DeepGEMM aligns the MN dimension of packed scales to 4 elements


class LayoutError(ValueError):
    """A tensor does not have the layout it claims; the message says what differs."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def swizzled_numel(rows: int, cols: int) -> int:
    """Bytes of a 128x4-swizzled ``[rows, cols]`` scale grid (padding included)."""
    return _cdiv(rows, SWIZZLE_ROWS) * SWIZZLE_ROWS * _cdiv(cols, SWIZZLE_COLS) * SWIZZLE_COLS


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """``[M, S]`` uint8 scales -> the flat 128x4-swizzled uint8 array (zero padded)."""
    if scales.dim() != 2 or scales.dtype != torch.uint8:
        raise LayoutError(f"scales: expected 2-D uint8, got {scales.dtype} {tuple(scales.shape)}")
    rows, cols = scales.shape
    mt, st = _cdiv(rows, SWIZZLE_ROWS), _cdiv(cols, SWIZZLE_COLS)
    padded = torch.zeros(mt * SWIZZLE_ROWS, st * SWIZZLE_COLS, dtype=torch.uint8)
    padded = padded.to(scales.device)
    padded[:rows, :cols] = scales
    # [mt, 4 (b), 32 (a), st, 4 (c)] -> [mt, st, a, b, c]
    tiles = padded.view(mt, 4, 32, st, SWIZZLE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().view(-1)


def unswizzle_128x4(
    flat: torch.Tensor, rows: int, cols: int, row_range: tuple[int, int] | None = None
) -> torch.Tensor:
    """The ``[rows, cols]`` uint8 scales of a flat 128x4-swizzled array (or only the
    rows ``row_range = (start, stop)``, reading just the 128-row tiles that hold them)."""
    data = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    if data.dim() != 1 or data.numel() != swizzled_numel(rows, cols):
        raise LayoutError(
            f"swizzled scales: expected a flat array of {swizzled_numel(rows, cols)} bytes "
            f"for a [{rows}, {cols}] grid, got shape {tuple(flat.shape)}"
        )
    start, stop = row_range or (0, rows)
    if not 0 <= start <= stop <= rows:
        raise LayoutError(f"row_range ({start}, {stop}) outside [0, {rows}]")
    st = _cdiv(cols, SWIZZLE_COLS)
    t0, t1 = start // SWIZZLE_ROWS, _cdiv(stop, SWIZZLE_ROWS)
    tiles = data.view(-1, st, 32, 4, SWIZZLE_COLS)[t0:t1]
    grid = tiles.permute(0, 3, 2, 1, 4).reshape((t1 - t0) * SWIZZLE_ROWS, st * SWIZZLE_COLS)
    base = t0 * SWIZZLE_ROWS
    return grid[start - base : stop - base, :cols]


def pack_ue8m0_rows(block_scales: torch.Tensor, rows: int, block_rows: int = 128) -> torch.Tensor:
    """Power-of-two float32 block scales ``[ceil(rows / block_rows), kb]`` -> DeepGEMM's
    packed int32 ``[rows, ceil(kb / 4)]`` with strides ``(1, align(rows, 4))``."""
    if block_scales.dtype != torch.float32 or block_scales.dim() != 2:
        raise LayoutError(
            f"block scales: expected 2-D float32, got {block_scales.dtype} "
            f"{tuple(block_scales.shape)}"
        )
    bits = block_scales.contiguous().view(torch.int32)
    if bool((bits & 0x807FFFFF).any()):
        raise LayoutError("block scales: UE8M0 packing needs positive powers of two")
    exponents = (bits >> 23).to(torch.uint8)  # [nb, kb]
    per_row = exponents.repeat_interleave(block_rows, 0)[:rows]  # [rows, kb]
    kb = per_row.shape[1]
    words = _cdiv(kb, UE8M0_PER_WORD)
    padded = torch.zeros(rows, words * UE8M0_PER_WORD, dtype=torch.uint8)
    padded = padded.to(block_scales.device)
    padded[:, :kb] = per_row
    packed = padded.view(torch.int32)  # [rows, words], little-endian bytes
    aligned = _cdiv(rows, TMA_ALIGN) * TMA_ALIGN
    storage = torch.zeros(words, aligned, dtype=torch.int32, device=block_scales.device)
    storage[:, :rows] = packed.T
    return storage.as_strided((rows, words), (1, aligned))


def unpack_ue8m0_rows(packed: torch.Tensor, k_blocks: int) -> torch.Tensor:
    """uint8 exponent bytes ``[rows, k_blocks]`` of DeepGEMM's packed UE8M0 rows (any
    strides: a row slice of the MN-major tensor is fine)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise LayoutError(
            f"packed UE8M0 scales: expected 2-D int32, got {packed.dtype} {tuple(packed.shape)}"
        )
    words = _cdiv(k_blocks, UE8M0_PER_WORD)
    if packed.shape[1] != words:
        raise LayoutError(
            f"packed UE8M0 scales: expected {words} words per row for {k_blocks} k-blocks, "
            f"got shape {tuple(packed.shape)}"
        )
    rows = packed.shape[0]
    # a fresh row-major copy: .contiguous() keeps the MN-major stride of a size-1 dim,
    # which a byte view refuses
    dense = torch.empty(packed.shape, dtype=torch.int32, device=packed.device).copy_(packed)
    return dense.view(torch.uint8).view(rows, words * UE8M0_PER_WORD)[:, :k_blocks]


def exponent_scales(exponents: torch.Tensor) -> torch.Tensor:
    """float32 ``2 ** (e - 127)`` of uint8 exponent bytes (e = 0 gives 0.0: a float32
    with exponent field 0 and no mantissa), exactly as the float32 bit pattern says."""
    return (exponents.to(torch.int32) << 23).view(torch.float32)
