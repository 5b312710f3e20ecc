"""The indexer's one dispatcher: which implementation a device's steps run.

``ReferenceKernels`` (the torch oracle behind the kernels' interface) on CPU, the Triton
indexer (``api``) on CUDA; ``impl`` forces one (tests: Triton on CPU tensors under
``TRITON_INTERPRET=1``). Both expose ``insert_keys``, ``paged_logits`` and ``index_topk``.
"""

from __future__ import annotations

import torch

from vllm_mla.ops.sparse_indexer import reference

IMPLS = ("auto", "triton", "reference")


class ReferenceKernels:
    """The torch oracle behind the kernels' interface (CPU)."""

    insert_keys = staticmethod(reference.insert_keys)

    @staticmethod
    def index_topk(q, weights, cache, block_tables, lengths, topk, *, max_len):
        return reference.index_topk(q.float(), weights, cache, block_tables, lengths, topk)

    @staticmethod
    def paged_logits(q, weights, cache, block_tables, lengths, *, max_len):
        """fp32 ``[T, max_len]`` logits of each token against its own request's keys,
        ``-inf`` at positions >= its length: ``reference.index_topk``'s, token by token."""
        q = q.float()
        out = torch.full((q.shape[0], max_len), float("-inf"), device=q.device)
        bs = cache.shape[1]
        for i in range(q.shape[0]):
            length = min(int(lengths[i]), max_len)
            if length <= 0:
                continue
            k, k_scale = reference.read_keys(
                cache, reference.request_rows(block_tables[i], length, bs)
            )
            out[i, :length] = reference.logits(q[i : i + 1], weights[i : i + 1], k, k_scale)[0]
        return out


def kernels_for(device: torch.device, impl: str = "auto") -> object:
    """The kernels serving ``device``: ``ReferenceKernels`` or the Triton ``api`` module."""
    if impl not in IMPLS:
        raise ValueError(f"indexer impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "reference" or (impl == "auto" and device.type != "cuda"):
        return ReferenceKernels
    from vllm_mla.ops.sparse_indexer import api  # Triton is optional

    return api
