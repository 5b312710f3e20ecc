"""The indexer's top-k under decode context parallelism (DCP): per-rank candidates, merge.

Under DCP each rank's index-key cache holds only its shard of every request
(``vllm_mla.ops.dcp``). A rank scores the keys it holds and keeps its local top-K
(``candidate_keys``); the ranks all-gather those candidates and each takes the global
top-K of the union (``merge_candidates``). Exact: a position in the global top-K has
fewer than K positions ranked above it, so fewer than K on its own rank, so it is in its
rank's local top-K (the order restricted to a rank is the same order: local position
order is request position order). vLLM 0.33 merges the same way
(``_merge_dcp_topk_global``, CuteDSL on CUDA only).

The order is the one selection contract (``reference.select_topk``): larger logit
first, a tie toward the lower request position, NaN first, -0.0 == +0.0. Each
candidate is one int64 key, the order-preserving int32 of its fp32 logit in the high
half and ``2**32 - 1 - position`` in the low half (``triton_kernels.select_topk``'s
key, with request positions), so ``torch.topk`` on distinct keys applies the rule, the
gathered tensor is one int64 ``[N, T, K]`` and the result is identical to the
selection without DCP for the same logits. Tensor ops only: no host sync, shapes fixed
by ``[T, K]`` (CUDA graphs).
"""

from __future__ import annotations

import torch

from vllm_mla.ops.dcp import DCPShard

EMPTY_KEY = -(2**63)  # no candidate (past the local length, or no token here)
_LOW = (1 << 32) - 1


def candidate_keys(
    scores: torch.Tensor, lengths: torch.Tensor, topk: int, shard: DCPShard
) -> torch.Tensor:
    """int64 ``[T, topk]``: this rank's top-``topk`` candidates of each row as keys,
    descending, ``EMPTY_KEY`` past ``min(topk, lengths[t])``.

    ``scores [T, S]``: logits of this rank's local positions ``0 .. S-1`` (those at
    ``>= lengths[t]`` are ignored); ``lengths [T]``: this rank's local lengths.
    """
    t, s = scores.shape
    x = scores.float() + 0.0  # -0.0 -> +0.0: the selection ties them
    x = x.masked_fill(x.isnan(), float("nan"))  # one NaN: every NaN ranks first
    bits = x.view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64) << 32
    local = torch.arange(s, device=scores.device)
    key += _LOW - shard.to_global(local)  # lower request position wins a tie
    key.masked_fill_(local[None, :] >= lengths.to(torch.int64)[:, None], EMPTY_KEY)
    out = torch.full((t, topk), EMPTY_KEY, dtype=torch.int64, device=scores.device)
    width = min(topk, s)
    if width:
        out[:, :width] = torch.topk(key, width, dim=1).values
    return out


def merge_candidates(gathered: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 ``[T, topk]`` request positions from every rank's ``candidate_keys``
    (``gathered [N, T, K]``, rank-major, ``K >= topk``): the global top-``topk``,
    descending, ``-1`` past the candidates there are."""
    n, t, k = gathered.shape
    keys = gathered.permute(1, 0, 2).reshape(t, n * k)
    top = torch.topk(keys, topk, dim=1).values
    positions = _LOW - (top & _LOW)
    return torch.where(top == EMPTY_KEY, -1, positions).to(torch.int32)


def dcp_select(
    scores: list[torch.Tensor], lengths: list[torch.Tensor], topk: int, interleave: int = 1
) -> torch.Tensor:
    """The DCP selection of ``N = len(scores)`` ranks at once (tests, benchmarks): rank
    ``r``'s local ``scores[r] [T, S_r]`` and ``lengths[r] [T]`` -> int32 ``[T, topk]``
    request positions (what every rank holds after the all-gather)."""
    n = len(scores)
    keys = [
        candidate_keys(s, length, topk, DCPShard(n, r, interleave))
        for r, (s, length) in enumerate(zip(scores, lengths, strict=True))
    ]
    return merge_candidates(torch.stack(keys), topk)


__all__ = ["EMPTY_KEY", "candidate_keys", "dcp_select", "merge_candidates"]
