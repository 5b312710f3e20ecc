"""``write_records``: the sparse backend's cache write (latents -> records at their slots).

The op's one shape: this contract and its checks, the torch reference
(:func:`write_records_reference`: pack with the format's codec, scatter), the Triton
kernel (``record_write_kernel``: nvfp4_ds_mla, the format vLLM only writes with SM100
PTX), one dispatcher (:func:`run`) and the custom op ``vllm_mla::write_kv_records``
(``custom_op``). vLLM's own ``concat_and_cache_mla`` keeps writing bf16 and fp8_ds_mla
records on CUDA; the reference writes every format on CPU.
"""

from __future__ import annotations

import torch

from vllm_mla.ops.base import TRITON_AVAILABLE, triton_runs_on
from vllm_mla.ops.sparse_mla.formats import (
    LATENT,
    ROPES,
    SparseMLAError,
    SparseMLATypeError,
    check_cache,
    check_format,
    pack_rows,
)

WRITE_IMPLS = ("auto", "triton", "reference")
# formats written by this project's Triton kernel on CUDA (vLLM writes the others, and
# nvfp4_ds_mla only with SM100 PTX); the vLLM impl and the DSv3.2 patch route by it
TRITON_WRITERS = ("nvfp4_ds_mla",)


def write_records_reference(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: str,
) -> None:
    """Torch: pack the first ``T = len(slot_mapping)`` rows with the format's codec and
    scatter them to their slots; slots < 0 are skipped."""
    tokens = slot_mapping.shape[0]
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    slots = slot_mapping[keep].long()
    rows = kv_c[:tokens][keep]
    pe = k_pe[:tokens].reshape(tokens, k_pe.shape[-1])[keep]  # rope 0: [T, 0]
    records = pack_rows(rows, pe, kv_format)
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = records.to(kv_cache.dtype)


def _check(kv_c, k_pe, kv_cache, slot_mapping, kv_format: str) -> torch.Tensor:
    """The contract; returns ``k_pe`` as ``[N, rope]``."""
    check_format(kv_format)
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        got = getattr(slot_mapping, "dtype", slot_mapping)
        raise SparseMLATypeError(f"slot_mapping: expected an int32/int64 Tensor, got {got!r}")
    if slot_mapping.dim() != 1:
        raise SparseMLAError(f"slot_mapping: expected [T], got shape {tuple(slot_mapping.shape)}")
    tokens = slot_mapping.shape[0]
    for name, t in (("kv_c", kv_c), ("k_pe", k_pe)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise SparseMLATypeError(f"{name}: expected a floating-point Tensor, got {t!r:.80}")
    pe = k_pe.reshape(k_pe.shape[0], k_pe.shape[-1]) if k_pe.dim() == 3 else k_pe
    if kv_c.dim() != 2 or kv_c.shape[1] != LATENT or kv_c.shape[0] < tokens:
        raise SparseMLAError(
            f"kv_c: expected [>= T={tokens}, {LATENT}], got shape {tuple(kv_c.shape)}"
        )
    if pe.dim() != 2 or pe.shape[1] not in ROPES or pe.shape[0] < tokens:
        raise SparseMLAError(
            f"k_pe: expected [>= T={tokens}, rope] or [>= T, 1, rope] with rope in {ROPES}, "
            f"got shape {tuple(k_pe.shape)}"
        )
    check_cache(kv_cache, kv_format, pe.shape[1])
    for name, t in (("kv_c", kv_c), ("k_pe", pe), ("slot_mapping", slot_mapping)):
        if t.device != kv_cache.device:
            raise SparseMLAError(f"{name}: on {t.device}, kv_cache on {kv_cache.device}")
    return pe


def resolve(impl: str, kv_format: str, device: torch.device) -> str:
    """``impl`` made concrete: ``auto`` is Triton on CUDA for a format it writes, else the
    reference; a forced ``triton`` that cannot run says why."""
    if impl not in WRITE_IMPLS:
        raise SparseMLAError(f"impl: expected one of {WRITE_IMPLS}, got {impl!r}")
    usable = TRITON_AVAILABLE and kv_format in TRITON_WRITERS
    if impl == "auto":
        return "triton" if usable and device.type == "cuda" else "reference"
    if impl == "triton":
        on_device = triton_runs_on(device)
        if not (usable and on_device):
            raise NotImplementedError(
                f"impl='triton' writes {TRITON_WRITERS} on a CUDA device (or CPU tensors "
                f"under TRITON_INTERPRET=1); got {kv_format!r} on {device}, triton "
                f"installed: {TRITON_AVAILABLE}"
            )
    return impl


def run(impl: str, kv_c, k_pe, kv_cache, slot_mapping, kv_format: str) -> None:
    """The one dispatcher: run a resolved ``impl`` on checked arguments."""
    if impl == "triton":
        from vllm_mla.ops.sparse_mla.record_write_kernel import launch_nvfp4_write

        return launch_nvfp4_write(kv_c, k_pe, kv_cache, slot_mapping)
    return write_records_reference(kv_c, k_pe, kv_cache, slot_mapping, kv_format)


def write_records(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: str,
    impl: str = "auto",
) -> None:
    """Write token ``t``'s record (``kv_c[t]`` and ``k_pe[t]``, rope 64 or 0) into
    ``kv_cache`` at physical row ``slot_mapping[t]`` for every ``t < T = len(slot_mapping)``
    with a slot >= 0; nothing else in the cache changes. Every implementation writes the
    same bytes (nvfp4_ds_mla: ``nvfp4_record.encode``'s)."""
    pe = _check(kv_c, k_pe, kv_cache, slot_mapping, kv_format)
    concrete = resolve(impl, kv_format, kv_cache.device)
    if kv_c.stride(-1) != 1 or (pe.shape[1] and pe.stride(-1) != 1):
        kv_c, pe = kv_c.contiguous(), pe.contiguous()
    torch.ops.vllm_mla.write_kv_records(kv_c, pe, kv_cache, slot_mapping, kv_format, concrete)
