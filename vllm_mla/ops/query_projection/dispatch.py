"""The query projection's one dispatcher: the fused Triton kernel where the gate admits
the call, else the staged reference (``custom_op`` -> ``run`` -> ``kernel.launch``)."""

from __future__ import annotations

import torch

from vllm_mla.ops.query_projection import reference
from vllm_mla.ops.query_projection.api import FUSED_ROPE, Args, can_fuse_query_projection


def run(args: Args, q_nope, q_pe, out: torch.Tensor, q_scale) -> None:
    """Write the query into ``out`` for validated ``args``: fused when gated in, else staged."""
    fuse = can_fuse_query_projection(
        num_heads=args.h,
        max_m=args.m,
        nope_dim=args.p,
        latent_dim=args.latent,
        out_dtype=out.dtype,
        weight_format=args.weight_format,
        device=q_nope.device,
    )
    if not fuse or args.rope != FUSED_ROPE:
        reference.staged(args, q_nope, q_pe, out, q_scale)
        return
    from vllm_mla.ops.query_projection import kernel  # Triton is optional

    kernel.launch(args, q_nope, q_pe, out, q_scale)
