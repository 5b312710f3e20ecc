"""DeepSeek-V4's MoE routing in torch: ``sqrtsoftplus`` scores, hash or biased top-k.

A token's expert scores are ``sqrt(softplus(logit))``. Hash-routed layers take each
token's experts from the checkpoint's table (``tid2eid`` of its id); the other layers
pick the ``k`` best of score + correction bias. Either way the weights are the chosen
experts' scores (no bias), renormalized to sum 1, times ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch


def scores(logits: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(logit))`` in fp32."""
    return torch.sqrt(torch.nn.functional.softplus(logits.float()))


def _weights(chosen: torch.Tensor, scale: float) -> torch.Tensor:
    return chosen / chosen.sum(-1, keepdim=True) * scale


def hash_topk(
    logits: torch.Tensor, experts: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights, int32 ids) ``[T, k]`` for the experts ``experts`` (``[T, k]``, each
    token's row of the hash table)."""
    ids = experts.long()
    return _weights(scores(logits).gather(-1, ids), scale), ids.to(torch.int32)


def biased_topk(
    logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights, int32 ids) ``[T, k]``: the ``k`` best of score + ``bias``."""
    s = scores(logits)
    ids = torch.topk(s + bias.float(), k, dim=-1).indices
    return _weights(s.gather(-1, ids), scale), ids.to(torch.int32)
