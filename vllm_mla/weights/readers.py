"""Chunk readers: pieces of the dense ``[N, K]`` kv_b_proj weight from each layout.

One function per decode kind of the kv_b_proj matrix (``vllm_mla.weights.forms``).
Row readers return ``W[a:b]`` in float32 (or the dense dtype, as a view); the column
reader runs the layer's own GEMM on a slice of the identity and returns
``W[:, a:b].T`` in the activation dtype. Every product is the one a whole-tensor
dequantization computes (one float32 multiply per element), so chunked and whole
results are bit-identical. Each reader declares the scratch bytes per row or column
it allocates, which the lifecycle turns into a bounded head group.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mla.formats import FP8_BLOCK
from vllm_mla.quant import layouts, mxfp8
from vllm_mla.weights import faults
from vllm_mla.weights.device import resolve_device
from vllm_mla.weights.sources import ChunkReader

SLACK = 64  # bytes per row for index and bookkeeping tensors


def _check_rows(a: int, b: int, rows: int) -> None:
    if not 0 <= a <= b <= rows:
        raise ValueError(f"rows [{a}, {b}) outside [0, {rows})")


def dense(weight: torch.Tensor) -> ChunkReader:
    """Views of an unquantized weight (no copy, no scratch)."""

    def read(a: int, b: int) -> torch.Tensor:
        _check_rows(a, b, weight.shape[0])
        return weight[a:b]

    return ChunkReader("rows", read, 0)


def _scale_blocks(deq: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """``deq[:, j] *= scale[:, j // block]`` in place (the last block may be partial)."""
    rows, cols = deq.shape
    full = cols // block
    if full:
        deq[:, : full * block].view(rows, full, block).mul_(scale[:, :full, None])
    if full * block < cols:
        deq[:, full * block :].mul_(scale[:, full : full + 1])


def fp8_block(values: torch.Tensor, scale_inv: torch.Tensor) -> ChunkReader:
    """e4m3 ``[N, K]`` with float32 scales per 128 x 128 block (``weight_scale_inv``)."""
    cols = values.shape[1]

    def read(a: int, b: int) -> torch.Tensor:
        _check_rows(a, b, values.shape[0])
        deq = values[a:b].to(torch.float32)
        rows = torch.arange(a, b, device=deq.device) // FP8_BLOCK
        _scale_blocks(deq, scale_inv[rows], FP8_BLOCK)
        return deq

    return ChunkReader("rows", read, 4 * cols + 12 * -(-cols // FP8_BLOCK) + SLACK)


def fp8_ue8m0_rows(values: torch.Tensor, packed: torch.Tensor) -> ChunkReader:
    """e4m3 ``[N, K]`` with DeepGEMM's packed per-row UE8M0 scales (int32, MN-major)."""
    cols = values.shape[1]
    k_blocks = -(-cols // FP8_BLOCK)

    def read(a: int, b: int) -> torch.Tensor:
        _check_rows(a, b, values.shape[0])
        deq = values[a:b].to(torch.float32)
        scale = layouts.exponent_scales(layouts.unpack_ue8m0_rows(packed[a:b], k_blocks))
        _scale_blocks(deq, scale, FP8_BLOCK)
        return deq

    words = packed.shape[1]
    return ChunkReader("rows", read, 4 * cols + 8 * words + 12 * k_blocks + SLACK)


def as_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows, C]`` from a tensor vLLM holds either as ``[rows, C]`` (any strides, e.g.
    XPU's MN-major scales) or as its transposed ``[C, rows]`` view (CuTe-DSL's weight).
    A square tensor is a transposed view when its rows are not contiguous."""
    if tensor.dim() != 2:
        return tensor
    square = tensor.shape[0] == tensor.shape[1]
    if tensor.shape[0] == rows and not (square and tensor.stride(1) != 1):
        return tensor
    return tensor.t()


def _mxfp8_rows(values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    deq = values.to(torch.float32)
    _scale_blocks(deq, mxfp8.decode_scales(codes), mxfp8.BLOCK_SIZE)
    return deq


def mxfp8_rows(values: torch.Tensor, scales: torch.Tensor, rows: int) -> ChunkReader:
    """e4m3 ``[N, K]`` with E8M0 scales ``[N, K / 32]`` (uint8 or float8_e8m0fnu, any strides;
    either may be held as its transposed view)."""
    values, codes = as_rows(values, rows), as_rows(scales, rows).view(torch.uint8)
    cols = values.shape[1]

    def read(a: int, b: int) -> torch.Tensor:
        _check_rows(a, b, values.shape[0])
        return _mxfp8_rows(values[a:b], codes[a:b])

    return ChunkReader("rows", read, 4 * cols + 12 * -(-cols // mxfp8.BLOCK_SIZE) + SLACK)


def mxfp8_swizzled(values: torch.Tensor, flat_scales: torch.Tensor, rows: int) -> ChunkReader:
    """e4m3 ``[N, K]`` (or its ``[K, N]`` view) with 128x4-swizzled flat E8M0 scales."""
    values = as_rows(values, rows)
    rows, cols = values.shape
    groups = cols // mxfp8.BLOCK_SIZE

    def read(a: int, b: int) -> torch.Tensor:
        _check_rows(a, b, rows)
        codes = layouts.unswizzle_128x4(flat_scales, rows, groups, (a, b))
        return _mxfp8_rows(values[a:b], codes)

    # unswizzling reads whole 128-row tiles: up to 2 tiles more than the rows asked for,
    # copied once by the reshape (the grid is padded to a multiple of 4 scales)
    padded = -(-groups // layouts.SWIZZLE_COLS) * layouts.SWIZZLE_COLS
    per_row = 4 * cols + 12 * groups + padded + SLACK
    return ChunkReader("rows", read, per_row + 2 * padded)


def apply_identity(module: nn.Module, method: object, act_dtype: torch.dtype) -> ChunkReader:
    """Columns of the weight through the layer's own GEMM: ``apply(eye[a:b])``.

    For layouts only their kernel can read (Marlin tiles, Humming). Each output row has
    one non-zero product, so any slicing of the identity gives exactly the values of
    upstream's whole ``apply(eye)``; the scratch is the identity slice and its output
    (plus whatever the kernel allocates itself, which we cannot bound).
    """
    cols = int(module.input_size_per_partition)
    out_features = int(module.output_size_per_partition)
    device = resolve_device(module)
    size = torch.empty((), dtype=act_dtype).element_size()

    def read(a: int, b: int) -> torch.Tensor:
        _check_rows(a, b, cols)
        faults.site("alloc", "identity")
        eye = torch.zeros(b - a, cols, dtype=act_dtype, device=device)
        eye[:, a:b].fill_diagonal_(1)
        out = method.apply(module, eye, bias=None)
        if tuple(out.shape) != (b - a, out_features):
            raise ValueError(
                f"kv_b_proj apply(identity[{a}:{b}]) returned shape {tuple(out.shape)}, "
                f"expected {(b - a, out_features)}"
            )
        return out

    return ChunkReader("cols", read, size * (cols + out_features) + 2 * cols + SLACK)
