"""The ``nvfp4_ds_mla`` record (352 bytes a token): layout, torch encoder and decoder.

The layout vLLM sizes its pages for (``state_content_bytes`` 352; FlashMLA's SM100 format):

- bytes ``[0, 256)``: the 512 latent (NoPE) values as e2m1 codes, two per byte, the even
  element in the low nibble;
- bytes ``[256, 320)``: the 64 RoPE values as e4m3, no scale, in ``k_pe``'s order;
- bytes ``[320, 352)``: 32 e4m3 scales, one per 16 latent values, block ``s`` stored at
  byte ``320 + 8 * (s & 3) + (s >> 2)`` (an 8 x 4 -> 4 x 8 transpose).

The rule (the encoder below is written from it; the Triton writer matches it byte for
byte): per block of 16, ``sf = e4m3(max(amax / 6, 2**-9))`` (round to nearest even,
saturating at 448), then each value ``q = x / sf`` (a true division) rounded to e2m1 to
nearest, ties to the even code, saturating at 6, the sign kept (-0 included). RoPE:
``e4m3(k_pe)``, nearest even, saturating. There is no per-tensor scale.

Decoding is exact: an e2m1 value (2 significant bits) times an e4m3 scale (4) has at
most 6 significant bits and lies in [2**-10, 2688], so it is a bf16 value.
"""

from __future__ import annotations

import torch

from vllm_mla.formats import (
    E2M1_MAX,
    E4M3_MAX,
    LATENT,
    NVFP4_BLOCK,
    NVFP4_DS_MLA_RECORD,
    NVFP4_SCALE_FLOOR,
    ROPE,
)

RECORD = NVFP4_DS_MLA_RECORD  # 352
ROPE_OFFSET = LATENT // 2  # 256
SCALES_OFFSET = ROPE_OFFSET + ROPE  # 320
BLOCKS = LATENT // NVFP4_BLOCK  # 32 scales a record
SCALE_FLOOR = NVFP4_SCALE_FLOOR  # 2**-9, the smallest e4m3 subnormal: sf is never 0
# e2m1 magnitudes by code (codes 0..7; bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# the midpoints between neighbouring magnitudes: a tie rounds to the even code
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def scale_byte(block: int) -> int:
    """Byte offset, within the scale slot, of latent block ``block``'s scale."""
    return 8 * (block & 3) + (block >> 2)


# SCALE_ORDER[j] = the block whose scale byte j holds (the inverse permutation)
SCALE_ORDER = tuple(sorted(range(BLOCKS), key=scale_byte))


def e2m1_codes(q: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, 0..15): nearest magnitude, ties to the even code,
    saturating at 6 (and inf), the sign bit kept (so -0 and values rounding to 0 from
    below give code 8)."""
    mag = q.abs()
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=mag.dtype, device=mag.device)
    code = torch.bucketize(mag, mids)  # midpoints strictly below: the lower neighbour
    tie = mag == mids[code.clamp(max=len(mids) - 1)]
    code = code + (tie & (code % 2 == 1)).long()  # a tie goes to the even code
    sign = torch.signbit(q).to(torch.long) << 3
    return (code | sign).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, 0..15) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def e4m3_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn codes (uint8): nearest even, saturating at +-448."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def block_scales(kv_c: torch.Tensor) -> torch.Tensor:
    """``[N, 32]`` e4m3 scales (fp32 values) of ``kv_c [N, 512]``: e4m3(max(amax/6, 2**-9))."""
    blocks = kv_c.float().reshape(kv_c.shape[0], BLOCKS, NVFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    sf = torch.clamp(amax / E2M1_MAX, min=SCALE_FLOOR)
    return e4m3_codes(sf).view(torch.float8_e4m3fn).float()


def encode(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``kv_c [N, 512]`` and ``k_pe [N, rope]`` (rope 64, or 0: the RoPE slot is zeroed)
    -> ``[N, 352]`` uint8 records, by the rule in the module docstring."""
    n = kv_c.shape[0]
    sf = block_scales(kv_c)  # [N, 32]
    blocks = kv_c.float().reshape(n, BLOCKS, NVFP4_BLOCK)
    codes = e2m1_codes(blocks / sf[..., None]).reshape(n, LATENT)
    out = torch.zeros(n, RECORD, dtype=torch.uint8, device=kv_c.device)
    out[:, :ROPE_OFFSET] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    if k_pe.shape[-1]:
        out[:, ROPE_OFFSET:SCALES_OFFSET] = e4m3_codes(k_pe)
    sf_codes = e4m3_codes(sf)
    order = torch.tensor(SCALE_ORDER, device=kv_c.device)
    out[:, SCALES_OFFSET:] = sf_codes[:, order]
    return out


def decode(records: torch.Tensor, rope: int = ROPE) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., 352]`` records -> ``(kv_c [..., 512], k_pe [..., rope])`` fp32, exact."""
    lead = records.shape[:-1]
    rec = records.contiguous()
    packed = rec[..., :ROPE_OFFSET]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*lead, LATENT)
    perm = torch.tensor([scale_byte(s) for s in range(BLOCKS)], device=rec.device)
    sf_codes = rec[..., SCALES_OFFSET:][..., perm]
    sf = sf_codes.view(torch.float8_e4m3fn).float()
    values = e2m1_values(codes).reshape(*lead, BLOCKS, NVFP4_BLOCK) * sf[..., None]
    k_pe = rec[..., ROPE_OFFSET : ROPE_OFFSET + rope].view(torch.float8_e4m3fn).float()
    return values.reshape(*lead, LATENT), k_pe
