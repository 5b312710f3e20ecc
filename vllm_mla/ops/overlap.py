"""Memory-overlap checks for the ops' ``out`` arguments (validation only, never a kernel).

Both are cheap (a few integer comparisons per dim): they run on every validated call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor


def self_overlapping(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` are one memory location (a stride-0 dim of size > 1,
    as ``expand`` makes): no op can write a correct answer into such a tensor."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True))


def span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` that the view can touch (``(0, 0)`` when empty)."""
    if t.numel() == 0:
        return 0, 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def has_memory(t: torch.Tensor) -> bool:
    """False for fake / meta tensors (tracing): they have no addresses to compare."""
    return not (isinstance(t, FakeTensor) or t.device.type == "meta")


def overlapping(out: torch.Tensor, inputs: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first input whose byte range intersects ``out``'s, else None
    (conservative: interleaved views that share no element count too; tensors without
    memory never overlap)."""
    if out.numel() == 0 or not has_memory(out):
        return None
    o0, o1 = span(out)
    for name, t in inputs:
        if t.numel() and has_memory(t):
            t0, t1 = span(t)
            if o0 < t1 and t0 < o1:
                return name
    return None
