"""What every op shares: the MXFP8 weight pair, whether Triton is importable, and the one
error for a kernel variant that would compile inside CUDA-graph capture."""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


class KernelNotPrewarmed(RuntimeError):
    """A kernel variant would compile inside CUDA-graph capture (prewarm it before)."""


class MXFP8Weight(NamedTuple):
    """An MXFP8 weight ``[B, K, N]``: e4m3 ``values`` and uint8 E8M0 ``scales`` with one code
    per 32 elements along its contracted or output axis (any strides)."""

    values: torch.Tensor
    scales: torch.Tensor
