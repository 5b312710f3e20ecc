"""DeepSeek-style block FP8 codec: float8_e4m3fn weights with one float32 scale per
128 x 128 block (``weight_scale_inv`` in DeepSeek-V3 checkpoints, multiplied in to dequantize).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_mla.formats import E4M3_MAX

BLOCK: tuple[int, int] = (128, 128)  # (rows, cols) per scale, as in DeepSeek-V3 checkpoints
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FP8BlockTensor:
    """``values`` (float8_e4m3fn ``[out, in]``) and ``scale_inv`` (float32
    ``[ceil(out / block[0]), ceil(in / block[1])]``; edge blocks may be partial), on one
    device."""

    values: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = BLOCK

    def __post_init__(self) -> None:
        if self.values.dtype != torch.float8_e4m3fn:
            raise TypeError(f"values: expected torch.float8_e4m3fn, got {self.values.dtype}")
        if self.scale_inv.dtype != torch.float32:
            raise TypeError(f"scale_inv: expected torch.float32, got {self.scale_inv.dtype}")
        if self.scale_inv.device != self.values.device:
            raise ValueError(
                f"scale_inv: expected device {self.values.device} (values'), "
                f"got {self.scale_inv.device}"
            )
        _check_block(self.block)
        if self.values.dim() != 2:
            raise ValueError(
                f"values: expected a 2-D [out, in] tensor, got shape {tuple(self.values.shape)}"
            )
        expected = _scale_shape(tuple(self.values.shape), self.block)
        if tuple(self.scale_inv.shape) != expected:
            raise ValueError(
                f"scale_inv shape: expected {expected} for values of shape "
                f"{tuple(self.values.shape)} and block {self.block}, "
                f"got {tuple(self.scale_inv.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        """Bytes of ``values`` plus ``scale_inv`` as viewed (numel * element_size)."""
        return sum(t.numel() * t.element_size() for t in (self.values, self.scale_inv))


def quantize(w: torch.Tensor, *, block: tuple[int, int] = BLOCK) -> FP8BlockTensor:
    """Quantize a 2-D ``w`` (float32/bfloat16/float16) per ``block``, computed in float32.

    Per block: ``scale = fl32(amax / 448)``, or 1.0 when that is 0 (``amax == 0``, or a
    subnormal amax whose quotient underflows); ``values = e4m3_rne(clamp(fl32(w / scale),
    -448, 448))``; ``scale_inv = scale``. A block holding NaN or +-Inf raises ValueError
    naming its block index, because a float32 block scale cannot mark a block as NaN.
    """
    if w.dtype not in INPUT_DTYPES:
        raise TypeError(f"w: expected one of {INPUT_DTYPES}, got {w.dtype}")
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D [out, in] tensor, got shape {tuple(w.shape)}")
    _check_block(block)
    rows, cols = w.shape
    br, bc = block
    n_br, n_bc = _scale_shape((rows, cols), block)

    # Zero padding completes the edge blocks without changing their amax.
    padded = torch.zeros(n_br * br, n_bc * bc, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(n_br, br, n_bc, bc)

    finite = torch.isfinite(blocks).all(dim=3).all(dim=1)
    if not bool(finite.all()):
        i, j = (int(k) for k in (~finite).nonzero()[0])
        raise ValueError(
            f"block ({i}, {j}) (rows {i * br}:{min((i + 1) * br, rows)}, "
            f"cols {j * bc}:{min((j + 1) * bc, cols)}) of w with shape {(rows, cols)} "
            "holds NaN or Inf; block FP8 has no NaN scale"
        )

    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    scale = torch.where(scale == 0, 1.0, scale)
    # Clamped explicitly because older torch casts turned |x| >= 480 into NaN.
    scaled = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    values = scaled.to(torch.float8_e4m3fn).view(n_br * br, n_bc * bc)[:rows, :cols]
    return FP8BlockTensor(values.contiguous(), scale.contiguous(), tuple(block))


def dequantize(
    t: FP8BlockTensor, dtype: torch.dtype = torch.float32, *, rows: slice | None = None
) -> torch.Tensor:
    """Decode ``t`` (or only its output ``rows``, a step-1 slice) to ``dtype``.

    Each element is ``fl32(float32(value) * scale_inv[block])``: one float32 multiply per
    element, as vLLM's block-FP8 dequant does. That correctly rounded product is deterministic
    and identical whether computed whole or in row chunks; it is then cast to ``dtype``.
    With ``rows``, only the scale rows covering them are read; the scales are gathered per
    (row, column block) and applied in place, so the only row-sized allocation is the fp32
    result itself and memory is proportional to the rows requested.
    """
    out_features, in_features = t.values.shape
    if rows is None:
        rows = slice(None)
    start, stop, step = rows.indices(out_features)
    if step != 1:
        raise ValueError(f"rows: expected a slice with step 1, got {rows}")
    stop = max(start, stop)
    br, bc = t.block

    # In place, one column block at a time: a float32 copy of the values is the only
    # row-sized allocation; scales are gathered per (row, block), never expanded.
    deq = t.values[start:stop].to(torch.float32)
    scale = t.scale_inv[torch.arange(start, stop, device=deq.device) // br]
    full = in_features // bc
    if full:
        deq[:, : full * bc].view(stop - start, full, bc).mul_(scale[:, :full, None])
    if full * bc < in_features:
        deq[:, full * bc :].mul_(scale[:, full : full + 1])
    return deq.to(dtype)


UE8M0_AMAX_FLOOR = 1e-4  # DeepGEMM's per_block_cast_to_fp8 clamps each block amax to this


def requantize_ue8m0(t: FP8BlockTensor) -> FP8BlockTensor:
    """``t`` re-quantized with power-of-two block scales, as DeepGEMM's post-load does in
    place when ``VLLM_USE_DEEP_GEMM_E8M0`` is on (vLLM's ``requant_weight_ue8m0_inplace``).

    Per block: ``w = dequantize(t)`` in float32, ``sf = 2 ** ceil(log2(max(amax, 1e-4) /
    448))``, ``values = e4m3_rne(w * (1 / sf))``; ``scale_inv = sf``. The values change
    (this is lossy), so the absorbed pair must be read from the requantized tensors.
    """
    w = dequantize(t, torch.float32)
    rows, cols = w.shape
    br, bc = t.block
    n_br, n_bc = _scale_shape((rows, cols), t.block)
    padded = torch.zeros(n_br * br, n_bc * bc, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(n_br, br, n_bc, bc)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(UE8M0_AMAX_FLOOR)
    sf = torch.pow(2.0, torch.ceil(torch.log2(amax / E4M3_MAX)))
    values = (blocks * (1.0 / sf)).to(torch.float8_e4m3fn).view(n_br * br, n_bc * bc)
    return FP8BlockTensor(
        values[:rows, :cols].contiguous(), sf.view(n_br, n_bc).contiguous(), tuple(t.block)
    )


def _check_block(block: tuple[int, int]) -> None:
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"block: expected two positive ints, got {block}")


def _scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
