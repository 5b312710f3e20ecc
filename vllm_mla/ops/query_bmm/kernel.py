"""The compiled kernel: ``vllm_mla._C`` (csrc/query_bmm.cu), loaded when built.

A stable-ABI library without a Python module init, loaded like any torch op library; it
defines the op's schema and CUDA kernel and names ``vllm_mla.ops.query_bmm.custom_op`` as
the home of the fake impl. A CPU-only torch cannot load it: never an import failure.
"""

from __future__ import annotations

import importlib.util

import torch

NAMESPACE, NAME = "vllm_mla", "safe_mla_query_bmm"
# Must match the schema csrc/query_bmm.cu defines.
SCHEMA = f"{NAME}(Tensor query, Tensor weight, Tensor(a!) out) -> ()"


def _load_extension() -> str | None:
    """Load ``vllm_mla._C`` (registers the CUDA op); returns why not, or None when loaded."""
    try:
        spec = importlib.util.find_spec("vllm_mla._C")
        if spec is None or spec.origin is None:
            return (
                "vllm_mla._C is not built (it builds with `pip install --no-build-isolation -e .` "
                "where torch has CUDA and nvcc is found)"
            )
        # A stable-ABI library without a Python module init: loaded like any torch op library.
        torch.ops.load_library(spec.origin)
    except Exception as exc:  # a CPU-only torch cannot load the CUDA build; never fail the import
        return f"vllm_mla._C could not be loaded: {type(exc).__name__}: {exc}"
    return None


_load_error = _load_extension()
_cpp_op = hasattr(getattr(torch.ops, NAMESPACE), NAME)


def cuda_op_available() -> bool:
    """True when the compiled CUDA kernel is registered (CUDA calls never copy the query)."""
    return _cpp_op


def cuda_op_error() -> str | None:
    """Why the compiled CUDA op is not available, or None when it is."""
    return None if _cpp_op else _load_error
