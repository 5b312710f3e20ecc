"""CUDA-graph capture and the dense ops' Triton variants (one definition of each).

Triton compiles a variant per constexpr set and pointer alignment. Every variant the
dense ops (absorbed BMM, query projection) launch is recorded here; asking for a new one
while the current stream is capturing raises ``KernelNotPrewarmed`` instead of compiling
(which would stall or break the capture).
"""

from __future__ import annotations

import torch

from vllm_mla.ops.base import KernelNotPrewarmed

_compiled: set[tuple] = set()


def capturing(device: torch.device) -> bool:
    """True while the current stream of a CUDA ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_compiled(key: tuple, device: torch.device, what: str) -> None:
    """Raise instead of compiling a new variant ``key`` while the stream is captured."""
    if key not in _compiled and capturing(device):
        raise KernelNotPrewarmed(
            f"{what} was not compiled before CUDA-graph capture: run every captured M "
            "once outside capture first (vllm_mla.ops.prewarm_query_projection / a "
            "warm-up step)"
        )


def record_compiled(key: tuple) -> None:
    """Note that variant ``key`` has been launched (compiled) in this process."""
    _compiled.add(key)


def compiled_variants() -> frozenset[tuple]:
    """The dense ops' variants launched so far in this process."""
    return frozenset(_compiled)
