"""What every op shares: the MXFP8 weight pair, whether Triton is importable and can run
on a device, and the one error for a kernel variant that would compile inside CUDA-graph
capture."""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


TRITON_MIN_CAPABILITY = (8, 0)  # the portable kernels' floor: no fp8 instruction below SM89


def triton_gpu(device: torch.device) -> bool:
    """Whether ``device`` is a GPU the portable Triton kernels serve (Triton, CUDA SM80+)."""
    return (
        TRITON_AVAILABLE
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= TRITON_MIN_CAPABILITY
    )


def triton_runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can launch on ``device``'s tensors: a CUDA device, or CPU
    tensors under ``TRITON_INTERPRET=1`` (the interpreter)."""
    from vllm_mla import envs

    cpu = device.type == "cpu" and envs.triton_interpret()
    return TRITON_AVAILABLE and (device.type == "cuda" or cpu)


class KernelNotPrewarmed(RuntimeError):
    """A kernel variant would compile inside CUDA-graph capture (prewarm it before)."""


class MXFP8Weight(NamedTuple):
    """An MXFP8 weight ``[B, K, N]``: e4m3 ``values`` and uint8 E8M0 ``scales`` with one code
    per 32 elements along its contracted or output axis (any strides)."""

    values: torch.Tensor
    scales: torch.Tensor
