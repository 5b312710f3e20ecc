"""Decode context parallelism (DCP): which rank of the DCP group holds a token, and where.

vLLM shards every request's KV cache over the ``size`` ranks of its DCP group in runs of
``interleave`` consecutive positions, round robin (``cp_kv_cache_interleave_size``; its
``ComputeSlotMappingKernel`` writes the slots, ``get_dcp_local_seq_lens`` counts them,
``triton_filter_and_convert_dcp_index`` maps selections back): request position ``p``
lives on rank ``(p // I) % N``, at position ``(p // (N * I)) * I + p % I`` of that rank's
own block table (the rank's local position). A rank attends to the selected positions
it holds; vLLM merges the ranks' outputs by their softmax LSE.

``DCPShard()`` (size 1) is the identity: every mapping below returns its input.
Tensor ops only (no host sync), so they run inside captured CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DCPShard:
    """One rank's share of a DCP group: ``size`` ranks, this ``rank``, ``interleave``."""

    size: int = 1
    rank: int = 0
    interleave: int = 1

    def __post_init__(self) -> None:
        for name in ("size", "rank", "interleave"):
            if not isinstance(getattr(self, name), int):
                raise TypeError(f"DCPShard.{name}: expected an int, got {getattr(self, name)!r}")
        if self.size < 1 or self.interleave < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"DCPShard: expected size >= 1, 0 <= rank < size, interleave >= 1; got "
                f"size {self.size}, rank {self.rank}, interleave {self.interleave}"
            )

    @property
    def trivial(self) -> bool:
        """One rank holds everything (no DCP)."""
        return self.size == 1

    @property
    def args(self) -> tuple[int, int, int]:
        """``(size, rank, interleave)``, the kernels' runtime arguments."""
        return self.size, self.rank, self.interleave

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """The rank holding each (non-negative) request position."""
        return positions.div(self.interleave, rounding_mode="floor").remainder(self.size)

    def to_local(self, positions: torch.Tensor) -> torch.Tensor:
        """Request positions -> this rank's local positions; -1 where another rank holds
        the position or it is negative (empty). Same dtype as ``positions``."""
        if self.trivial:
            return positions
        n, i = self.size, self.interleave
        held = (positions >= 0) & (self.owner(positions) == self.rank)
        local = positions.div(n * i, rounding_mode="floor") * i + positions.remainder(i)
        return torch.where(held, local, -1).to(positions.dtype)

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's local positions -> request positions; -1 stays -1 (negative)."""
        if self.trivial:
            return local
        n, i = self.size, self.interleave
        glob = local.div(i, rounding_mode="floor") * (n * i) + self.rank * i + local.remainder(i)
        return torch.where(local >= 0, glob, -1).to(local.dtype)

    def local_length(self, lengths: torch.Tensor) -> torch.Tensor:
        """How many of the first ``lengths`` request positions this rank holds (vLLM's
        ``get_dcp_local_seq_lens``)."""
        if self.trivial:
            return lengths
        n, i = self.size, self.interleave
        base = lengths.div(n * i, rounding_mode="floor") * i
        rest = (lengths - base * n - self.rank * i).clamp(0, i)
        return (base + rest).to(lengths.dtype)

    def local_bound(self, length: int) -> int:
        """An upper bound of any rank's local length for a request of ``length``."""
        n, i = self.size, self.interleave
        return -(-length // (n * i)) * i


NO_DCP = DCPShard()


def lse_merge(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's merge of the DCP ranks' attention by their LSE (``_lse_weighted_combine``,
    vllm/v1/attention/ops/dcp.py, natural log), as a torch reference: ``outputs [N, T, H,
    D]`` and ``lses [N, T, H]`` -> (``[T, H, D]`` fp32, ``[T, H]``). A rank whose lse is
    -inf, inf or NaN (none of its tokens selected) weighs nothing."""
    lses = torch.where(lses.isnan() | lses.isinf(), float("-inf"), lses)
    peak = lses.max(dim=0).values
    peak = torch.where(peak == float("-inf"), 0.0, peak)
    weights = torch.exp(lses - peak)
    weights = torch.where(weights.isnan(), 0.0, weights)
    total = weights.sum(dim=0, keepdim=True)
    weights = (weights / total.clamp(min=1e-10)).unsqueeze(-1)
    merged = torch.where(weights == 0, 0.0, outputs.float() * weights).sum(dim=0)
    return merged, torch.log(total[0]) + peak


__all__ = ["NO_DCP", "DCPShard", "lse_merge"]
