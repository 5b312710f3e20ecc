"""``safe_mla_query_bmm``: ``out[h] = query[h] @ weight[h]`` without reading outside the views.

Shapes ``query [H, T, Q] x weight [H, Q, L] -> out [H, T, L]``, all bfloat16; only the last
dim of each operand must be contiguous (the decode query is the strided view
``q[..., :P].transpose(0, 1)``). Numeric contract: fp32 accumulation, result rounded to bf16.

The compiled CUDA op (``vllm_mla._C``, csrc/query_bmm.cu) reads and writes only elements of the
three views and never copies the query; it exists because cuBLAS batched BF16 GEMM on SM12x reads
past strided operands and faults. Without it, CUDA runs ``torch.bmm`` (on SM12x on a contiguous
copy of the query, the known-safe workaround, logged once) and CPU always runs ``torch.bmm``.
The op is ``torch.ops.vllm_mla.safe_mla_query_bmm`` on every machine, with a fake impl, so
``torch.compile(fullgraph=True)`` and CUDA-graph capture can trace it.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from vllm_mla.ops import overlap

logger = logging.getLogger("vllm_mla")

_NS, _NAME = "vllm_mla", "safe_mla_query_bmm"
_QUALNAME = f"{_NS}::{_NAME}"
# Must match the schema csrc/query_bmm.cu defines.
_SCHEMA = f"{_NAME}(Tensor query, Tensor weight, Tensor(a!) out) -> ()"
_LAYOUT = {"query": "[H, T, Q]", "weight": "[H, Q, L]", "out": "[H, T, L]"}


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
_cpp_op = hasattr(getattr(torch.ops, _NS), _NAME)


def cuda_op_available() -> bool:
    """True when the compiled CUDA kernel is registered (CUDA calls never copy the query)."""
    return _cpp_op


def cuda_op_error() -> str | None:
    """Why the compiled CUDA op is not available, or None when it is."""
    return None if _cpp_op else _load_error


# ---------------------------------------------------------------------------------------------
# Operator registration. The C++ library, when loaded, already defined the schema and the CUDA
# kernel (and names this module as the home of the fake impl, which is registered from here).

_lib = torch.library.Library(_NS, "FRAGMENT")  # keeps the registrations below alive


def _bmm_into(query: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(torch.bmm(query, weight))


@functools.cache
def _is_sm12x(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 12


@functools.cache
def _log_copy_path_once() -> None:
    logger.warning(
        "safe_mla_query_bmm: the CUDA op is not built (%s); on SM12x it runs torch.bmm on a "
        "contiguous copy of the query (safe, one extra copy per call)",
        _load_error,
    )


def _cuda_fallback(query: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    if _is_sm12x(query.device.index):
        _log_copy_path_once()
        # cuBLAS on SM12x over-reads strided operands; contiguous ones are safe.
        query, weight = query.contiguous(), weight.contiguous()
    _bmm_into(query, weight, out)


if not _cpp_op:
    _lib.define(_SCHEMA)
    _lib.impl(_NAME, _cuda_fallback, "CUDA")
_lib.impl(_NAME, _bmm_into, "CPU")


@torch.library.register_fake(_QUALNAME, lib=_lib)
def _fake(query: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    return None  # mutates out in place; no new tensor


# ---------------------------------------------------------------------------------------------
# Public entry point.


def _validate(query: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    args = {"query": query, "weight": weight, "out": out}
    for name, t in args.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"safe_mla_query_bmm: {name} must be a torch.Tensor, got {type(t)}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"safe_mla_query_bmm: {name} must be torch.bfloat16, got {t.dtype}")
    for name, t in args.items():
        if t.dim() != 3:
            raise ValueError(
                f"safe_mla_query_bmm: {name} must be 3-D {_LAYOUT[name]}, "
                f"got shape {tuple(t.shape)}"
            )
    # (operand, dim, symbol, reference operand, reference dim)
    for name, dim, sym, ref, ref_dim in (
        ("weight", 0, "H", "query", 0),
        ("weight", 1, "Q", "query", 2),
        ("out", 0, "H", "query", 0),
        ("out", 1, "T", "query", 1),
        ("out", 2, "L", "weight", 2),
    ):
        if args[name].shape[dim] != args[ref].shape[ref_dim]:
            raise ValueError(
                f"safe_mla_query_bmm: {name}.shape[{dim}] ({sym}) is {args[name].shape[dim]} but "
                f"{ref} has {sym} = {args[ref].shape[ref_dim]}; expected query [H, T, Q] x "
                f"weight [H, Q, L] -> out [H, T, L], got query {tuple(query.shape)}, "
                f"weight {tuple(weight.shape)}, out {tuple(out.shape)}"
            )
    for name, t in args.items():
        # A size-1 last dim is only read at index 0, so its stride is irrelevant.
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(
                f"safe_mla_query_bmm: {name}'s last dim must be contiguous (stride 1), got "
                f"strides {t.stride()} for shape {tuple(t.shape)}"
            )
    for name in ("weight", "out"):
        if args[name].device != query.device:
            raise ValueError(
                f"safe_mla_query_bmm: {name} is on {args[name].device} but query is on "
                f"{query.device}; all operands must share one device"
            )
    problem = overlap.out_problem(out, (("query", query), ("weight", weight)))
    if problem is not None:
        raise ValueError(f"safe_mla_query_bmm: {problem}")


def safe_mla_query_bmm(
    query: torch.Tensor, weight: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Write ``query @ weight`` (batched over H) into ``out`` and return ``out``.

    Raises TypeError (not a tensor, not bf16) or ValueError (rank, shapes, a last dim that is
    not contiguous, mixed devices, ``out`` overlapping an input or itself), naming the argument.
    """
    _validate(query, weight, out)
    torch.ops.vllm_mla.safe_mla_query_bmm(query, weight, out)
    return out
