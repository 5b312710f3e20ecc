"""``torch.ops.vllm_mla.mla_query_projection`` (mutates ``out``): the op torch.compile and
CUDA graphs see; validated at every call (under torch.compile only the op runs)."""

from __future__ import annotations

import torch

from vllm_mla.ops.base import MXFP8Weight
from vllm_mla.ops.query_projection import dispatch
from vllm_mla.ops.query_projection.api import validate


@torch.library.custom_op("vllm_mla::mla_query_projection", mutates_args=("out",))
def _projection_op(
    q_nope: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
) -> None:
    weight = w_values if w_scales is None else MXFP8Weight(w_values, w_scales)
    dispatch.run(validate(q_nope, weight, q_pe, out, q_scale), q_nope, q_pe, out, q_scale)


@_projection_op.register_fake
def _(q_nope, w_values, w_scales, q_pe, out, q_scale) -> None:
    return None
