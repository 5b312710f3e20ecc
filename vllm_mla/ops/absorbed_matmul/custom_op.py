"""``torch.ops.vllm_mla.absorbed_bmm_out`` (mutates ``out``) and ``absorbed_bmm``
(functional, optionally the row layout): the ops torch.compile and CUDA graphs see, with
fake impls that allocate only what the real ones return."""

from __future__ import annotations

import torch

from vllm_mla.ops.absorbed_matmul import dispatch


@torch.library.custom_op("vllm_mla::absorbed_bmm_out", mutates_args=("out",))
def _bmm_out_op(
    a: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    out: torch.Tensor,
    role: str = "",
    path: str = "",
) -> None:
    dispatch.run(a, values, scales, out, role, path)


@_bmm_out_op.register_fake
def _(a, values, scales, out, role="", path="") -> None:
    return None


@torch.library.custom_op("vllm_mla::absorbed_bmm", mutates_args=())
def _bmm_op(
    a: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    role: str = "",
    path: str = "",
    row_width: int = 0,
) -> torch.Tensor:
    out = dispatch.new_out(a, values.shape[2], row_width)
    dispatch.run(a, values, scales, out, role, path)
    return out


@_bmm_op.register_fake
def _(a, values, scales, role="", path="", row_width=0):
    return dispatch.new_out(a, values.shape[2], row_width)
