"""The query BMM in plain torch (the CPU kernel and the reference)."""

from __future__ import annotations

import torch


def bmm_into(query: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """``out = query @ weight`` via ``torch.bmm`` (a temporary, then one copy)."""
    out.copy_(torch.bmm(query, weight))
