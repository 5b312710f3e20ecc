"""The one place DeepSeek-V4's record writer, compressor and attention pick and run an
implementation.

- ``triton``: ``triton_kernels`` (CUDA SM80+, no fp8 instruction; on CPU tensors only under
  ``TRITON_INTERPRET=1`` and only when asked for by name).
- ``reference``: ``record.write`` / ``compressor.entries`` / ``attention.attend`` in torch
  (the CPU default).

Both check their arguments here first, so either implementation sees the same validated
call and an error names the tensor at fault.
"""

from __future__ import annotations

import torch

from vllm_mla import envs
from vllm_mla.formats import DSV4_HEAD, DSV4_RECORD, DSV4_WRITERS
from vllm_mla.ops.base import TRITON_AVAILABLE, triton_gpu, triton_runs_on
from vllm_mla.ops.dsv4 import attention, compressor, record

IMPLS = ("auto", "triton", "reference")


def resolve(impl: str, device: torch.device) -> str:
    """``impl`` made concrete for ``device`` (``auto``: Triton on an SM80+ GPU, else the
    reference); a forced implementation that cannot run there is an error naming why."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if triton_gpu(device) else "reference"
    if impl == "triton" and not triton_runs_on(device):
        raise NotImplementedError(
            f"impl='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 for CPU "
            f"tensors); got device {device}, triton installed: {TRITON_AVAILABLE}"
        )
    return impl


def _check_cache(name: str, cache: torch.Tensor, block_size: int) -> None:
    if cache.dtype != torch.uint8:
        raise ValueError(f"{name}: a DeepSeek-V4 cache is uint8, got {cache.dtype}")
    page = cache[0].numel() if cache.dim() > 1 else 0
    if page != block_size * DSV4_RECORD or not cache.view(cache.shape[0], -1).stride(1) == 1:
        raise ValueError(
            f"{name}: a page of {block_size} DeepSeek-V4 records is {block_size * DSV4_RECORD} "
            f"contiguous bytes, got shape {tuple(cache.shape)}"
        )


def _check_slots(name: str, slots: torch.Tensor, tokens: int) -> torch.Tensor:
    if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 2:
        got = f"{slots.dtype} {tuple(slots.shape)}"
        raise ValueError(f"{name}: expected int32/int64 [T, N], got {got}")
    if slots.shape[0] != tokens:
        raise ValueError(f"{name}: {slots.shape[0]} rows for {tokens} query tokens")
    return slots if slots.stride(-1) == 1 else slots.contiguous()


def write(
    cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    writer: str = "cpu",
    impl: str = "auto",
) -> None:
    """Store ``rows`` (``[T, 512]``) as 584-byte records at ``slots`` (``[T]``; negative:
    skipped) of the paged ``cache``, by ``writer``'s rule (``record`` module)."""
    if rows.dim() != 2 or rows.shape[-1] != DSV4_HEAD:
        raise ValueError(f"rows: a DeepSeek-V4 KV row is [T, {DSV4_HEAD}], got {tuple(rows.shape)}")
    if slots.dim() != 1 or slots.shape[0] != rows.shape[0]:
        raise ValueError(f"slots: expected [{rows.shape[0]}], got {tuple(slots.shape)}")
    if writer not in DSV4_WRITERS:
        raise ValueError(f"writer must be one of {DSV4_WRITERS}, got {writer!r}")
    _check_cache("cache", cache, block_size)
    if resolve(impl, rows.device) == "reference":
        record.write(cache, rows, slots, block_size, writer)
        return
    from vllm_mla.ops.dsv4 import triton_kernels  # Triton is optional

    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    triton_kernels.launch_write(cache, rows, slots.contiguous(), block_size, writer == "cpu")


def attend(
    q: torch.Tensor,
    window_cache: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache: torch.Tensor | None,
    compressed_slots: torch.Tensor | None,
    compressed_block_size: int,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """``attention.attend``'s contract, written to ``out`` (``[T, H, 512]``; default a new
    fp32 tensor) and returned."""
    if q.dim() != 3 or q.shape[-1] != DSV4_HEAD:
        raise ValueError(f"q: queries are [T, H, {DSV4_HEAD}], got {tuple(q.shape)}")
    tokens, heads = q.shape[:2]
    window_slots = _check_slots("window_slots", window_slots, tokens)
    _check_cache("window_cache", window_cache, window_block_size)
    if compressed_slots is not None:
        compressed_slots = _check_slots("compressed_slots", compressed_slots, tokens)
        if compressed_slots.shape[1]:
            if compressed_cache is None:
                raise ValueError("compressed_slots given without compressed_cache")
            _check_cache("compressed_cache", compressed_cache, compressed_block_size)
    if sink.shape != (heads,):
        raise ValueError(f"sink: one logit per head, [{heads}], got {tuple(sink.shape)}")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out: expected {tuple(q.shape)} with a contiguous last dim")
    if resolve(impl, q.device) == "reference":
        got = attention.attend(
            q, window_cache, window_slots, window_block_size, compressed_cache,
            compressed_slots, compressed_block_size, sink, scale,
        )  # fmt: skip
        return out.copy_(got)
    from vllm_mla.ops.dsv4 import triton_kernels  # Triton is optional

    triton_kernels.launch_attend(
        q if q.stride(-1) == 1 else q.contiguous(),
        window_cache, window_slots, window_block_size,
        compressed_cache, compressed_slots, compressed_block_size,
        sink.float().contiguous(), scale, out, envs.triton_interpret(),
    )  # fmt: skip
    return out


def compressed_rows(
    state_cache: torch.Tensor,
    gather_slots: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
    ratio: int,
    impl: str = "auto",
) -> torch.Tensor:
    """``compressor.entries``' contract: ``[T, D]`` fp32 rows, each window-ending token's
    window (``gather_slots`` ``[T, W]`` of the fp32 ``state_cache``) compressed, normed and
    turned, ready for ``write`` (D 512) or the indexer's key writer (D 128)."""
    width = weight.numel()
    if state_cache.dtype != torch.float32 or state_cache.dim() != 3:
        raise ValueError(
            f"state_cache: fp32 [blocks, block_size, 2 * coff * D], got {state_cache.dtype} "
            f"{tuple(state_cache.shape)}"
        )
    coff = gather_slots.shape[-1] // ratio if gather_slots.dim() == 2 else 0
    if coff not in (1, 2) or gather_slots.shape[-1] != coff * ratio:
        raise ValueError(
            f"gather_slots: [T, ratio or 2 * ratio] for ratio {ratio}, got "
            f"{tuple(gather_slots.shape)}"
        )
    if state_cache.shape[-1] != 2 * coff * width or state_cache.stride(-1) != 1:
        raise ValueError(
            f"state_cache: rows of 2 * {coff} * {width} contiguous values for a {width}-wide "
            f"norm and a window of {gather_slots.shape[-1]}, got {tuple(state_cache.shape)}"
        )
    if positions.shape != gather_slots.shape[:1]:
        raise ValueError(f"positions: [{gather_slots.shape[0]}], got {tuple(positions.shape)}")
    if resolve(impl, state_cache.device) == "reference":
        return compressor.entries(state_cache, gather_slots, positions, weight, eps, cos_sin, ratio)
    from vllm_mla.ops.dsv4 import triton_kernels  # Triton is optional

    out = torch.empty(gather_slots.shape[0], width, dtype=torch.float32, device=weight.device)
    triton_kernels.launch_compress(
        state_cache, gather_slots.contiguous(), positions.contiguous(), weight.float().contiguous(),
        eps, cos_sin.float().contiguous(), ratio, out,
    )  # fmt: skip
    return out
