"""Memory-overlap checks for the ops' ``out`` arguments (validation only, never a kernel).

They are cheap (a few integer comparisons per dim): they run on every validated call.
``out_problem`` is the one rule every op applies; each op raises it as its own typed error.
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


def out_problem(
    out: torch.Tensor, inputs: Iterable[tuple[str, torch.Tensor]] = (), name: str = "out"
) -> str | None:
    """Why ``out`` cannot be written (its elements alias each other, or it overlaps one of
    ``inputs``), as an error message naming it; None when it can. The overlap with inputs
    is not checked while torch.compile traces (traced values have no addresses)."""
    if self_overlapping(out):
        return (
            f"{name}: expected distinct memory per element, got a stride-0 dim (strides "
            f"{tuple(out.stride())}, shape {tuple(out.shape)}): {name} has elements that share "
            "memory, so no correct answer can be written into it"
        )
    if torch.compiler.is_compiling():
        return None
    other = overlapping(out, inputs)
    if other is None:
        return None
    (o0, o1), (t0, t1) = span(out), span(dict(inputs)[other])
    return (
        f"{name}: expected a buffer separate from the inputs, got one overlapping {other} in "
        f"memory ({name} overlaps {other}: {name} bytes [{o0:#x}, {o1:#x}), {other} bytes "
        f"[{t0:#x}, {t1:#x}))"
    )
