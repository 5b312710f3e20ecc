"""The kpool indexer's one dispatcher: ``ReferenceKernels`` (the torch oracle) on CPU,
``TritonKernels`` on CUDA; ``impl`` forces one (tests: Triton on CPU tensors under
``TRITON_INTERPRET=1``). Both expose ``compress_pools``, ``insert_pools`` and
``pool_topk`` (pool ids of the top ``select_k`` pools, V3.2's selection over the pool cache).
"""

from __future__ import annotations

import torch

from vllm_mla.ops.kpool_indexer import reference
from vllm_mla.ops.sparse_indexer import dispatch as dsa_dispatch

IMPLS = dsa_dispatch.IMPLS  # ("auto", "triton", "reference")


class ReferenceKernels:
    """The torch oracle behind the kernels' interface (CPU)."""

    @staticmethod
    def compress_pools(k, gate, ape, out):
        out.copy_(reference.compress_pools(k, gate, ape))
        return out

    insert_pools = staticmethod(reference.insert_pools)

    @staticmethod
    def pool_topk(q, weights, cache, block_tables, pool_counts, select_k, *, max_pools):
        return dsa_dispatch.ReferenceKernels.index_topk(
            q, weights, cache, block_tables, pool_counts, select_k, max_len=max_pools
        )


class TritonKernels:
    """The Triton kernels (CUDA SM80+, or CPU under ``TRITON_INTERPRET=1``)."""

    @staticmethod
    def compress_pools(k, gate, ape, out):
        from vllm_mla.ops.kpool_indexer import custom_op  # noqa: F401  (registers)

        torch.ops.vllm_mla.kpool_compress_pools(k, gate, ape, out)
        return out

    @staticmethod
    def insert_pools(cache, rotated, slots, *, ue8m0=True):
        from vllm_mla.ops.sparse_indexer import api

        api.insert_keys(cache, rotated, slots, ue8m0=ue8m0)

    @staticmethod
    def pool_topk(q, weights, cache, block_tables, pool_counts, select_k, *, max_pools):
        from vllm_mla.ops.sparse_indexer import api

        lengths = pool_counts.to(torch.int32)
        return api.index_topk(
            q, weights, cache, block_tables.to(torch.int32), lengths, select_k, max_len=max_pools
        )


def kernels_for(device: torch.device, impl: str = "auto") -> type:
    """The kernels serving ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"kpool indexer impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "reference" or (impl == "auto" and device.type != "cuda"):
        return ReferenceKernels
    return TritonKernels
