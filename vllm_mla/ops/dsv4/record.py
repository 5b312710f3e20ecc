"""DeepSeek-V4's fp8 KV record (vLLM's 584-byte ``fp8_ds_mla`` for head 512), in torch.

A page of ``B`` tokens is ``B * 584`` bytes: first ``B`` data rows of 576 bytes (448 e4m3
NoPE values, then the 64 RoPE values as bf16, little-endian), then ``B`` scale rows of 8
bytes (7 UE8M0 exponents, one per 64 NoPE values, and a zero pad). Writers quantize the
bf16-rounded row: per 64-value block ``scale = 2**ceil(log2(amax / 448))``, each value
``e4m3(x / scale)`` (nearest even, saturated at 448), the exponent stored as ``code =
exponent + 127`` clamped to [0, 255]. vLLM's writers differ for small values
(``writer``): its Triton writers (``"triton"``, ``fused_compress_quant_cache.py``) floor
the amax at 1e-4 and keep e4m3 subnormals; vLLM CPU's ``_C`` writers (``"cpu"``) floor
``amax / 448`` at 1e-4 (no scale under 2**-13) and store a zero of its sign for a scaled
value under e4m3's smallest normal, 2**-6. ``tests_vllm`` checks the ``"cpu"`` rule
against vLLM CPU's own writer byte for byte.

A slot is ``block * B + row``; a negative slot is no token (writes skip it, reads give
zeros).
"""

from __future__ import annotations

import torch

from vllm_mla.formats import (
    DSV4_DATA_BYTES,
    DSV4_FLOOR,
    DSV4_HEAD,
    DSV4_NOPE,
    DSV4_QUANT_BLOCK,
    DSV4_RECORD,
    DSV4_SCALE_BYTES,
    DSV4_WRITERS,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E8M0_BIAS,
)

BLOCKS = DSV4_NOPE // DSV4_QUANT_BLOCK  # 7


def scaled(x: torch.Tensor, writer: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Each last-dim block of fp32 ``x`` over its power-of-two scale, by ``writer``'s rule
    (module docstring): (the values, clamped and, for ``"cpu"``, flushed; ready for
    e4m3, the exponents ``[...]``)."""
    amax = x.abs().amax(-1)
    if writer == "triton":
        ratio = amax.clamp_min(DSV4_FLOOR) / E4M3_MAX
    else:
        ratio = (amax / E4M3_MAX).clamp_min(DSV4_FLOOR)
    exponent = torch.ceil(torch.log2(ratio))
    values = (x * torch.exp2(-exponent)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    if writer == "cpu":
        # flushed to a zero of the value's sign (-0 stays negative, as _C stores it)
        values = torch.where(values.abs() < E4M3_MIN_NORMAL, values * 0.0, values)
    return values, exponent


def quantize(rows: torch.Tensor, writer: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 512]`` rows to (``[T, 576]`` data bytes, ``[T, 8]`` scale bytes), as
    ``writer`` (one of ``DSV4_WRITERS``) stores them."""
    if rows.shape[-1] != DSV4_HEAD:
        raise ValueError(f"a DeepSeek-V4 KV row is {DSV4_HEAD} wide, got {tuple(rows.shape)}")
    if writer not in DSV4_WRITERS:
        raise ValueError(f"writer must be one of {DSV4_WRITERS}, got {writer!r}")
    x = rows.to(torch.bfloat16).float()
    values, exponent = scaled(x[:, :DSV4_NOPE].reshape(-1, BLOCKS, DSV4_QUANT_BLOCK), writer)
    data = torch.empty(x.shape[0], DSV4_DATA_BYTES, dtype=torch.uint8, device=x.device)
    data[:, :DSV4_NOPE] = values.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, DSV4_NOPE)
    rope = x[:, DSV4_NOPE:].to(torch.bfloat16).contiguous()
    data[:, DSV4_NOPE:] = rope.view(torch.uint8)
    scales = torch.zeros(x.shape[0], DSV4_SCALE_BYTES, dtype=torch.uint8, device=x.device)
    scales[:, :BLOCKS] = (exponent + E8M0_BIAS).clamp(0, 255).to(torch.uint8)
    return data, scales


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(``[T, 576]``, ``[T, 8]``) bytes back to ``[T, 512]`` fp32 rows (exact)."""
    nope = data[:, :DSV4_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    exponent = scales[:, :BLOCKS].float() - E8M0_BIAS
    nope = nope.reshape(-1, BLOCKS, DSV4_QUANT_BLOCK) * torch.exp2(exponent)[..., None]
    rope = data[:, DSV4_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.reshape(-1, DSV4_NOPE), rope], dim=-1)


def _split(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache's data rows ``[blocks, B, 576]`` and scale rows ``[blocks, B, 8]``
    (views)."""
    pages = cache.view(cache.shape[0], -1)
    if pages.shape[1] != block_size * DSV4_RECORD:
        raise ValueError(
            f"a page of {block_size} DeepSeek-V4 records is {block_size * DSV4_RECORD} bytes, "
            f"got {pages.shape[1]}"
        )
    split = block_size * DSV4_DATA_BYTES
    data = pages[:, :split].view(-1, block_size, DSV4_DATA_BYTES)
    return data, pages[:, split:].view(-1, block_size, DSV4_SCALE_BYTES)


def write(
    cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    writer: str = "cpu",
) -> None:
    """Store ``rows`` (``[T, 512]``) at ``slots`` of the uint8 paged ``cache``."""
    data, scales = _split(cache, block_size)
    keep = slots >= 0
    slot = slots[keep].long()
    values, exps = quantize(rows[keep], writer)
    data[slot // block_size, slot % block_size] = values
    scales[slot // block_size, slot % block_size] = exps


def read(cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """The ``[*slots.shape, 512]`` fp32 rows at ``slots`` (zeros where a slot is negative)."""
    data, scales = _split(cache, block_size)
    flat = slots.reshape(-1).long()
    at = flat.clamp_min(0)
    rows = dequantize(
        data[at // block_size, at % block_size], scales[at // block_size, at % block_size]
    )
    rows[flat < 0] = 0
    return rows.view(*slots.shape, DSV4_HEAD)
