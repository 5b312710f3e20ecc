"""Whether the current CUDA stream is being captured into a graph (one definition)."""

from __future__ import annotations

import torch


def capturing(device: torch.device) -> bool:
    """True while the current stream of a CUDA ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
