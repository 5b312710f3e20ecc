"""The Triton indexer's argument checks (shared by its public calls and custom ops)."""

from __future__ import annotations

import torch

from vllm_mla import envs
from vllm_mla.ops.base import triton_gpu
from vllm_mla.ops.sparse_indexer.reference import IndexerError, _check_cache


def expect(name: str, ok: bool, expected: str, got: object) -> None:
    if not ok:
        raise IndexerError(f"{name}: expected {expected}, got {got}")


def check_runnable(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for x in tensors[1:]:
        expect("device", x.device == device, f"every tensor on {device}", x.device)
    if device.type == "cpu" and envs.triton_interpret():
        return
    if triton_gpu(device):
        return
    raise NotImplementedError(
        f"the Triton indexer needs a CUDA device of SM80 or later (or TRITON_INTERPRET=1 for "
        f"CPU tensors); got device {device}: use vllm_mla.ops.sparse_indexer.reference there"
    )


def check_pages(cache: torch.Tensor) -> None:
    _check_cache(cache)
    # The scales are read and written as float32 at page + block_size * 128 + 4 * slot.
    aligned = cache.data_ptr() % 4 == 0 and cache.stride(0) % 4 == 0
    expect("index-key cache", aligned, "4-byte aligned pages", (cache.data_ptr(), cache.stride()))
