"""``safe_mla_query_bmm``: ``out[h] = query[h] @ weight[h]`` without reading outside the
views; the public API and its contract.

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

import torch

from vllm_mla.ops import overlap

_LAYOUT = {"query": "[H, T, Q]", "weight": "[H, Q, L]", "out": "[H, T, L]"}


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
