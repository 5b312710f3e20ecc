"""The portable (Triton) DSA lightning indexer for CUDA SM80+, its public calls and contract:
key insert, paged logits, top-k.

Same numeric contract as ``reference`` (its module docstring), checked against it:

- ``insert_keys``: bit-exact e4m3 bytes and float32 scales. The e4m3 encode and the
  ue8m0 rounding are done on the bits (like torch's cast and the reference's fp32 log2),
  so no fp8 type is needed (SM80).
- ``paged_logits``: fp32 results within ``LOGIT_RTOL`` (below) of the reference; only the
  order of the fp32 sums differs.
- ``select_topk``: identical to ``reference.select_topk`` (plain torch, exact tie rule).
- ``index_topk``: identical to ``reference.index_topk`` except where two logits lie
  within the logit tolerance of each other at a place the order depends on.

Every op is a torch custom op (``vllm_mla::indexer_insert_keys``, ``_paged_logits``,
``_select_topk``; fake impls registered; ``index_topk`` is the last two in a row) with
grids and temporaries fixed by shapes and no host sync, so it can be captured in a CUDA
graph (``custom_op``). On CPU the Triton kernels run only under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from vllm_mla.ops.sparse_indexer import custom_op as _custom_op  # noqa: F401  (registers)
from vllm_mla.ops.sparse_indexer.triton_kernels import LOGIT_ATOL, LOGIT_RTOL
from vllm_mla.ops.sparse_indexer.validate import expect

__all__ = ["LOGIT_ATOL", "LOGIT_RTOL", "index_topk", "insert_keys", "paged_logits", "select_topk"]


def insert_keys(
    cache: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, *, ue8m0: bool = True
) -> None:
    """Quantize ``k [T, 128]`` (bf16/fp16/fp32) row-wise and write row ``t`` at physical
    slot ``slots[t]`` (int32/int64); bytes and scales bit-identical to
    ``reference.insert_keys``. Slots < 0 or past the pool are skipped."""
    torch.ops.vllm_mla.indexer_insert_keys(cache, k, slots, ue8m0)


def paged_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[T, S]`` logits of each token against its request's keys, within
    ``LOGIT_RTOL`` of ``reference.logits``; ``-inf`` at positions >= ``lengths[t]``.

    ``q [T, H, 128]`` float8_e4m3fn or bf16, ``weights [T, H]`` fp32, ``block_tables
    [T, W]`` int32 (the block-table row of each token's request), ``lengths [T]`` int32.
    ``S`` is ``out.shape[1]`` or ``max_len``: positions >= S are not computed (a length
    past S is cut to S), nor are positions past the block table or on a table entry
    outside the pool (``-inf``). No host sync; shapes fix the grid (CUDA graphs).
    """
    if out is None:
        expect("max_len", max_len is not None and max_len >= 0, "an int >= 0 (or out)", max_len)
        out = torch.empty(q.shape[0], max_len, dtype=torch.float32, device=q.device)
    elif max_len is not None:
        expect("out", out.dim() == 2 and out.shape[1] == max_len, f"[T, {max_len}]", out.shape)
    torch.ops.vllm_mla.indexer_paged_logits(q, weights, cache, block_tables, lengths, out)
    return out


def select_topk(
    scores: torch.Tensor, lengths: torch.Tensor, topk: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """int32 ``[T, topk]``, identical to ``reference.select_topk``: per row the ``topk``
    largest of ``scores[t, :lengths[t]]``, ties toward the lower position, descending,
    ``-1`` past ``min(topk, lengths[t], S)`` (``topk`` may exceed ``S``).

    Plain torch, batched, no host sync (portable and CUDA-graph capturable): one int64
    key per score, ``order-preserving int32 of the score << 32 | (S - 1 - position)``,
    so ``torch.topk`` on distinct keys applies the tie rule exactly. Temporary memory:
    ~3 int64 ``[T, S]`` tensors.
    """
    expect("topk", isinstance(topk, int) and topk >= 1, "an int >= 1", topk)
    if out is None:
        out = torch.empty(scores.shape[0], topk, dtype=torch.int32, device=scores.device)
    expect("out", out.dim() == 2 and out.shape[-1] == topk, f"[T, {topk}]", tuple(out.shape))
    torch.ops.vllm_mla.indexer_select_topk(scores, lengths, out)
    return out


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
    *,
    max_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 ``[T, topk]`` request-local positions, the result contract of
    ``reference.index_topk`` (for ``max_len >= max(lengths)``): ``paged_logits`` into an
    fp32 ``[T, max_len]`` buffer, then ``select_topk``. Two custom ops, no host sync."""
    scores = paged_logits(q, weights, cache, block_tables, lengths, max_len=max_len)
    return select_topk(scores, lengths, topk, out=out)
