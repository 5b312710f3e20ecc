"""The kpool indexer's custom op (``vllm_mla::kpool_compress_pools``): validated at every
call, fake impl registered, grid fixed by shapes, no host sync (CUDA-graph capturable)."""

from __future__ import annotations

import torch

from vllm_mla.formats import INDEX_HEAD_DIM
from vllm_mla.ops.kpool_indexer import triton_kernels as kernels
from vllm_mla.ops.kpool_indexer.reference import expect
from vllm_mla.ops.sparse_indexer.validate import check_runnable

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def check_compress(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, out: torch.Tensor):
    """Every rule the kernel relies on, each error naming the tensor."""
    d = INDEX_HEAD_DIM
    ok = k.dim() == 3 and k.shape[-1] == d and k.stride(-1) == 1
    expect("k", ok, f"[P, kpool, {d}] with unit last stride", (tuple(k.shape), k.stride()))
    expect("k", k.dtype in FLOATS, f"dtype in {FLOATS}", k.dtype)
    p, kpool, _ = k.shape
    expect("k", kpool >= 1, "kpool = k.shape[1] >= 1", tuple(k.shape))
    ok = gate.shape == k.shape and gate.stride(-1) == 1
    expect("gate", ok, f"k's shape {tuple(k.shape)}, unit last stride", tuple(gate.shape))
    expect("gate", gate.dtype in FLOATS, f"dtype in {FLOATS}", gate.dtype)
    ok = ape.shape == (kpool, d) and ape.stride(-1) == 1
    expect("ape", ok, f"[{kpool}, {d}] with unit last stride", tuple(ape.shape))
    expect("ape", ape.dtype == torch.float32, "dtype torch.float32", ape.dtype)
    ok = out.shape == (p, d) and out.stride(-1) == 1
    expect("out", ok, f"[{p}, {d}] with unit last stride", tuple(out.shape))
    expect("out", out.dtype == torch.bfloat16, "dtype torch.bfloat16", out.dtype)
    check_runnable(k, gate, ape, out)


@torch.library.custom_op("vllm_mla::kpool_compress_pools", mutates_args=("out",))
def _compress_pools_op(
    k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, out: torch.Tensor
) -> None:
    check_compress(k, gate, ape, out)
    if k.shape[0] == 0:
        return
    kernels.launch_compress_pools(k, gate, ape, out)


@_compress_pools_op.register_fake
def _(k, gate, ape, out):
    return None
