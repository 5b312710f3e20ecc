"""Sparse-MLA KV cache records: layout, torch packers and the row reader.

A cache is ``[num_blocks, block_size, record]``; physical row ``r`` lives at
``cache[r // block_size, r % block_size]``, addressed through strides (dim 0 may be
wider than a page: other layers' pages interleave). Three record formats:

- ``fp8_ds_mla`` (FlashMLA's sparse cache format), uint8, 656 bytes: bytes
  ``[0, 512)`` e4m3 of ``kv_c / scale[i // 128]``, ``[512, 528)`` four fp32 scales,
  ``[528, 656)`` 64 bf16 post-RoPE ``k_pe``. ``kv_c[i] = e4m3[i] * scale[i // 128]``.
- ``bf16``: ``[..., 576]`` bf16, ``kv_c`` (512) then ``k_pe`` (64); 1152 bytes.
- ``nvfp4_ds_mla`` (vLLM's NVFP4 NoPE + FP8 RoPE record), uint8, 352 bytes: 512 e2m1
  two per byte, 64 e4m3 RoPE values, 32 permuted e4m3 scales (``nvfp4_record``).

``KV_FORMAT_TABLE`` declares the formats once: each one's record, the vLLM cache dtypes
served as it, the requests canonicalised to it, its codec and whether b12x reads it.
Every other list of formats (the backend's accepted dtypes, the canonicalisation patch,
the impl's dtype -> format map, the kernels' readers) is derived from it.

RoPE width ``rope`` (``ROPES``: 64, or 0 for latent-512 MLA without RoPE, GLM-5.3-Flash):
with rope 0 an fp8_ds_mla record keeps its 656 bytes (vLLM sizes the page by the format,
``state_content_bytes``, and its writer copies a 0-wide ``k_pe``) and the rope slot
``[528, 656)`` is never read (its bytes are whatever the page held); a bf16 record is
``kv_c`` alone, 512 wide.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_mla.formats import (
    DS_MLA_SCALE_GROUP,
    E4M3_MAX,
    FP8_DS_MLA_RECORD,
    HEAD_DIM,
    LATENT,
    NVFP4_DS_MLA_RECORD,
    ROPE,
)
from vllm_mla.ops.sparse_mla import nvfp4_record

SCALE_GROUP = DS_MLA_SCALE_GROUP  # fp8_ds_mla: one fp32 scale per 128 latent values
FP8_SCALES_OFFSET = LATENT  # 512
FP8_ROPE_OFFSET = LATENT + 4 * (LATENT // SCALE_GROUP)  # 528
ROPES = (ROPE, 0)  # the RoPE widths served: 64 (DeepSeek / GLM-5), 0 (GLM-5.3-Flash)


# One rule for every implementation (reference, Triton, b12x runner): an index outside
# [-1, num_blocks * block_size) is read as an empty slot, like -1 (never a stray read),
# and, when the caller passes an ``invalid`` counter (int32 [1]), adds 1 to it.
INDEX_RULE = "an index outside [-1, rows) is an empty slot and is counted in `invalid`"


class SparseMLAError(ValueError):
    """A sparse-MLA argument does not match the contract (names it: expected vs actual)."""


class SparseMLATypeError(SparseMLAError, TypeError):
    """A sparse-MLA argument has the wrong dtype or type."""


class SparseMLANotPrepared(RuntimeError):
    """A sparse-MLA kernel variant would compile inside CUDA-graph capture."""


@dataclass(frozen=True)
class KVFormat:
    """One KV record format of the sparse backend, declared once (``KV_FORMAT_TABLE``)."""

    name: str  # the kernels' name for it (``kv_format``)
    elem: torch.dtype  # the cache tensor's element dtype
    elems: int  # elements per record at rope 64
    rope_slot: tuple[int, int] | None  # fixed-width records: the RoPE slot [start, end)
    cache_dtypes: tuple[str, ...]  # vLLM ``kv_cache_dtype`` values served as this format
    requested_as: tuple[str, ...]  # requests the sparse feature canonicalises to it
    reader: str  # how the Triton kernel reads a latent row: "bf16", "fp8" or "nvfp4"
    b12x_recipe: str | None  # b12x's ModelType with the same record; None: b12x declines
    pack: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (kv_c, k_pe) -> records
    unpack: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (records, rope) -> rows
    summary: str  # what a record holds, for users (capacity view, docs)

    def record_elems(self, rope: int = ROPE) -> int:
        """Elements per record at RoPE width ``rope``."""
        return self.elems if self.keeps_width else self.elems - ROPE + rope

    @property
    def keeps_width(self) -> bool:
        """At rope 0 the record keeps its width (vLLM sizes the page by the format) and
        its RoPE slot is never read."""
        return self.rope_slot is not None


def _check_rows(kv_c: torch.Tensor, k_pe: torch.Tensor) -> None:
    rope = k_pe.shape[-1] if isinstance(k_pe, torch.Tensor) and k_pe.dim() == 2 else ROPE
    if rope not in ROPES:
        rope = ROPE  # named below as the expected width
    for name, t, width in (("kv_c", kv_c, LATENT), ("k_pe", k_pe, rope)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise SparseMLATypeError(f"{name}: expected a floating-point Tensor, got {t!r:.80}")
        if t.dim() != 2 or t.shape[1] != width:
            raise SparseMLAError(f"{name}: expected [N, {width}], got shape {tuple(t.shape)}")
    if kv_c.shape[0] != k_pe.shape[0]:
        raise SparseMLAError(
            f"k_pe: expected [N={kv_c.shape[0]}, {k_pe.shape[1]}] (kv_c's N), "
            f"got {tuple(k_pe.shape)}"
        )


def pack_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Pack rows into 656-byte fp8_ds_mla records ``[N, 656]`` uint8.

    Scale per 128 values = amax / 448 (1.0 for an all-zero group, so zeros stay zero);
    k_pe is stored as bf16; a 0-wide k_pe (rope 0) leaves the rope slot zero.
    """
    _check_rows(kv_c, k_pe)
    n = kv_c.shape[0]
    groups = kv_c.float().reshape(n, LATENT // SCALE_GROUP, SCALE_GROUP)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    e4m3 = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch.empty(n, FP8_DS_MLA_RECORD, dtype=torch.uint8, device=kv_c.device)
    out[:, :FP8_SCALES_OFFSET] = e4m3.reshape(n, LATENT).view(torch.uint8)
    out[:, FP8_SCALES_OFFSET:FP8_ROPE_OFFSET] = scale.contiguous().view(torch.uint8)
    if k_pe.shape[1]:
        out[:, FP8_ROPE_OFFSET:] = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)
    else:  # rope 0: the slot is unread; zero, never uninitialised memory
        out[:, FP8_ROPE_OFFSET:] = 0
    return out


def pack_bf16(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Pack rows into bf16 records ``[N, 512 + rope]`` (kv_c then k_pe, rounded to bf16)."""
    _check_rows(kv_c, k_pe)
    return torch.cat([kv_c, k_pe], dim=-1).to(torch.bfloat16)


def pack_nvfp4_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Pack rows into 352-byte nvfp4_ds_mla records ``[N, 352]`` uint8 (``nvfp4_record``'s
    rule; a 0-wide k_pe leaves the rope slot zero)."""
    _check_rows(kv_c, k_pe)
    return nvfp4_record.encode(kv_c, k_pe)


def _unpack_fp8(records: torch.Tensor, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    lead = records.shape[:-1]
    rec = records.contiguous()
    e4m3 = rec[..., :FP8_SCALES_OFFSET].view(torch.float8_e4m3fn).float()
    # fresh contiguous copies before the wider views: a record view may start at any byte
    # offset (a plain clone keeps a dense view's strides)
    dense = torch.contiguous_format
    scale = rec[..., FP8_SCALES_OFFSET:FP8_ROPE_OFFSET].clone(memory_format=dense)
    scale = scale.view(torch.float32)
    kv_c = e4m3.reshape(*lead, -1, SCALE_GROUP) * scale[..., None]
    if rope == 0:  # nothing to view (an empty copy's strides suit no wider dtype)
        return kv_c.reshape(*lead, LATENT), kv_c.new_zeros(*lead, 0)
    pe = rec[..., FP8_ROPE_OFFSET : FP8_ROPE_OFFSET + 2 * rope].clone(memory_format=dense)
    k_pe = pe.view(torch.bfloat16).float()
    return kv_c.reshape(*lead, LATENT), k_pe


def _unpack_bf16(records: torch.Tensor, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    return records[..., :LATENT].float(), records[..., LATENT : LATENT + rope].float()


KV_FORMAT_TABLE: tuple[KVFormat, ...] = (
    KVFormat(
        name="fp8_ds_mla",
        elem=torch.uint8,
        elems=FP8_DS_MLA_RECORD,
        rope_slot=(FP8_ROPE_OFFSET, FP8_DS_MLA_RECORD),
        cache_dtypes=("fp8_ds_mla",),
        requested_as=("fp8", "fp8_e4m3"),
        reader="fp8",
        b12x_recipe="GLM_NSA",
        pack=pack_fp8_ds_mla,
        unpack=_unpack_fp8,
        summary="512 e4m3 + 4 fp32 scales (one per 128) + 64 bf16 RoPE",
    ),
    KVFormat(
        name="bf16",
        elem=torch.bfloat16,
        elems=HEAD_DIM,
        rope_slot=None,
        cache_dtypes=("auto", "bfloat16"),  # auto: the model dtype, served for bf16 models
        requested_as=(),
        reader="bf16",
        b12x_recipe=None,
        pack=pack_bf16,
        unpack=_unpack_bf16,
        summary="512 + 64 bf16",
    ),
    KVFormat(
        name="nvfp4_ds_mla",
        elem=torch.uint8,
        elems=NVFP4_DS_MLA_RECORD,
        rope_slot=(nvfp4_record.ROPE_OFFSET, nvfp4_record.SCALES_OFFSET),
        cache_dtypes=("nvfp4_ds_mla",),
        requested_as=(),
        reader="nvfp4",
        b12x_recipe=None,
        pack=pack_nvfp4_ds_mla,
        unpack=nvfp4_record.decode,
        summary="512 e2m1 + 32 e4m3 scales (one per 16) + 64 e4m3 RoPE",
    ),
)
FORMAT: dict[str, KVFormat] = {f.name: f for f in KV_FORMAT_TABLE}
KV_FORMATS = tuple(FORMAT)  # the kernels' format names
# vLLM kv_cache_dtype -> format (after canonicalisation), and user request -> format
FORMAT_OF_CACHE_DTYPE = {d: f.name for f in KV_FORMAT_TABLE for d in f.cache_dtypes}
FORMAT_OF_REQUEST = {d: f.name for f in KV_FORMAT_TABLE for d in f.requested_as}
ACCEPTED_CACHE_DTYPES = (*FORMAT_OF_CACHE_DTYPE, *FORMAT_OF_REQUEST)


def cache_rows(kv_cache: torch.Tensor) -> int:
    """Physical rows a cache addresses: ``num_blocks * block_size``."""
    return kv_cache.shape[0] * kv_cache.shape[1]


def check_format(kv_format: str) -> None:
    """Raise SparseMLAError unless ``kv_format`` is one of KV_FORMATS."""
    if kv_format not in KV_FORMATS:
        raise SparseMLAError(f"kv_format: expected one of {KV_FORMATS}, got {kv_format!r}")


def record_dtype(kv_format: str) -> torch.dtype:
    """Element dtype of a cache in ``kv_format`` (uint8 or bf16)."""
    check_format(kv_format)
    return FORMAT[kv_format].elem


def check_rope(rope: int) -> None:
    """Raise SparseMLAError unless ``rope`` is one of ROPES."""
    if rope not in ROPES:
        raise SparseMLAError(f"rope: expected a qk_rope_head_dim in {ROPES}, got {rope!r}")


def record_elems(kv_format: str, rope: int = ROPE) -> int:
    """Last-dim size of a cache in ``kv_format`` (656, 576 or 352; rope 0: 656, 512 or
    352)."""
    check_format(kv_format)
    check_rope(rope)
    return FORMAT[kv_format].record_elems(rope)


def record_width(kv_format: str, rope: int = ROPE) -> tuple[int, torch.dtype]:
    """(elements per cache row, element dtype) of ``kv_format``."""
    return record_elems(kv_format, rope), record_dtype(kv_format)


def record_bytes(kv_format: str, rope: int = ROPE) -> int:
    """Bytes per token: 656 for fp8_ds_mla, 1152 for bf16, 352 for nvfp4_ds_mla (rope 0:
    656, 1024, 352)."""
    n, dtype = record_width(kv_format, rope)
    return n * torch.empty((), dtype=dtype).element_size()


def check_cache(kv_cache: object, kv_format: str, rope: int = ROPE) -> None:
    """Raise a typed error unless ``kv_cache`` is a 3-D cache in ``kv_format``."""
    n, dtype = record_width(kv_format, rope)
    if not isinstance(kv_cache, torch.Tensor):
        raise SparseMLATypeError(f"kv_cache: expected a Tensor, got {type(kv_cache)}")
    if kv_cache.dtype != dtype:
        raise SparseMLATypeError(
            f"kv_cache: format {kv_format} expects dtype {dtype}, got {kv_cache.dtype}"
        )
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != n:
        raise SparseMLAError(
            f"kv_cache: format {kv_format} expects [num_blocks, block_size, {n}], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise SparseMLAError(
            f"kv_cache: last dim must be contiguous (stride 1), got strides {kv_cache.stride()}"
        )


def pack_rows(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_format: str) -> torch.Tensor:
    """Pack rows into records of ``kv_format``."""
    check_format(kv_format)
    return FORMAT[kv_format].pack(kv_c, k_pe)


def unpack_records(
    records: torch.Tensor, kv_format: str, rope: int = ROPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode records ``[..., record]`` into ``(kv_c [..., 512], k_pe [..., rope])`` fp32
    (rope 0: a fixed-width record's rope slot is not read)."""
    check_rope(rope)
    check_format(kv_format)
    return FORMAT[kv_format].unpack(records, rope)


def unpack_rows(
    kv_cache: torch.Tensor, rows: torch.Tensor, kv_format: str, rope: int = ROPE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read physical rows (any shape, all in range) -> ``(kv_c [..., 512], k_pe [..., rope])``
    fp32, addressing the cache through its strides."""
    check_cache(kv_cache, kv_format, rope)
    block_size = kv_cache.shape[1]
    rows = rows.long()
    records = kv_cache[rows // block_size, rows % block_size]
    return unpack_records(records, kv_format, rope)
