"""The kpool indexer's public calls and their contract (reference on CPU, Triton on CUDA
SM80+; ``impl`` forces one). Importing this module needs no Triton.

- ``compress_pools``: bf16 ``[P, 128]`` rotated pool keys; the Triton kernel equals
  ``reference.compress_pools`` within ``triton_kernels.COMPRESS_RTOL`` (bit-identical
  under the interpreter; only ``exp`` may differ on a GPU).
- ``insert_pools``: the V3.2 index-key insert (bit-exact e4m3 bytes and fp32 scales).
- ``index_topk``: int32 ``[T, output_width(topk, kpool)]`` token indices, the contract of
  ``reference.index_topk``; on CUDA the pool logits and exact top-k are the V3.2 Triton
  indexer's (``ops.sparse_indexer.api``), equal to the reference except at pools whose
  logits lie within its ``LOGIT_RTOL`` of the boundary.
- ``quantize_query``, ``fold_weights``, ``expand_pools_and_tail``, ``output_width``,
  ``compressed_slot_mapping``: plain torch on any device (``reference``'s).

Every call checks its arguments and raises ``IndexerError`` naming the tensor, the
expected shape / dtype and what it got.
"""

from __future__ import annotations

import torch

from vllm_mla.formats import INDEX_HEAD_DIM
from vllm_mla.ops.kpool_indexer import reference
from vllm_mla.ops.kpool_indexer.dispatch import kernels_for
from vllm_mla.ops.kpool_indexer.reference import (
    IndexerError,
    check_kpool,
    compressed_slot_mapping,
    expand_pools_and_tail,
    expect,
    fold_weights,
    output_width,
    quantize_query,
)

__all__ = [
    "IndexerError",
    "compress_pools",
    "compressed_slot_mapping",
    "expand_pools_and_tail",
    "fold_weights",
    "index_topk",
    "insert_pools",
    "output_width",
    "quantize_query",
]


def compress_pools(
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """bf16 ``[P, 128]``: each pool's softmax(gate + ape)-weighted key mean, rotated by
    Hadamard-128, before the fp8 cast. ``k/gate [P, kpool, 128]`` (bf16/fp16/fp32),
    ``ape [kpool, 128]`` fp32."""
    reference._check_pool_inputs(k, gate, ape)
    expect("k", k.shape[1] >= 1, "kpool = k.shape[1] >= 1", tuple(k.shape))
    if out is None:
        out = torch.empty(k.shape[0], INDEX_HEAD_DIM, dtype=torch.bfloat16, device=k.device)
    ok = out.shape == (k.shape[0], INDEX_HEAD_DIM) and out.dtype == torch.bfloat16
    expect("out", ok, f"bf16 [{k.shape[0]}, {INDEX_HEAD_DIM}]", (out.dtype, tuple(out.shape)))
    return kernels_for(k.device, impl).compress_pools(k, gate, ape, out)


def insert_pools(
    cache: torch.Tensor,
    rotated: torch.Tensor,
    slots: torch.Tensor,
    *,
    round_scale: bool = True,
    impl: str = "auto",
) -> None:
    """Quantize rotated pool keys ``[P, 128]`` (floor 1e-4; ue8m0 when ``round_scale``) and
    write row ``p`` at pool-cache slot ``slots[p]`` (< 0: skip)."""
    kernels_for(cache.device, impl).insert_pools(cache, rotated, slots, ue8m0=round_scale)


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    kpool: int,
    *,
    max_pools: int,
    width: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """int32 ``[T, width]`` request-local token indices (``reference.index_topk``).

    ``q [T, H, 128]`` rotated e4m3 (or bf16), ``weights [T, H]`` fp32 folded, ``cache``
    the pool cache ``[num_blocks, block_size, 132]`` uint8, ``block_tables [T, W]`` int,
    ``seq_lens [T]`` int token-granular causal lengths, ``max_pools >= max(seq_lens) //
    kpool`` (the logits' width; a host bound, so no sync).
    """
    check_kpool(kpool, topk)
    ok = isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[-1] == INDEX_HEAD_DIM
    expect("q", ok, f"[T, H, {INDEX_HEAD_DIM}]", reference._describe(q))
    t, h, _ = q.shape
    ok = isinstance(weights, torch.Tensor) and tuple(weights.shape) == (t, h)
    expect(
        "weights",
        ok and weights.dtype == torch.float32,
        f"fp32 [{t}, {h}]",
        reference._describe(weights),
    )
    ok = isinstance(seq_lens, torch.Tensor) and tuple(seq_lens.shape) == (t,)
    ok = ok and not seq_lens.is_floating_point() and seq_lens.dtype != torch.bool
    expect("seq_lens", ok, f"an integer [{t}]", reference._describe(seq_lens))
    ok = isinstance(block_tables, torch.Tensor) and block_tables.dim() == 2
    ok = ok and block_tables.shape[0] == t and not block_tables.is_floating_point()
    expect("block_tables", ok, f"an integer [{t}, W]", reference._describe(block_tables))
    expect("max_pools", isinstance(max_pools, int) and max_pools >= 0, "an int >= 0", max_pools)
    pool_counts = seq_lens.long().clamp_min(0) // kpool
    pool_ids = kernels_for(q.device, impl).pool_topk(
        q, weights, cache, block_tables, pool_counts, topk // kpool, max_pools=max_pools
    )
    return expand_pools_and_tail(pool_ids, seq_lens, kpool, width)
