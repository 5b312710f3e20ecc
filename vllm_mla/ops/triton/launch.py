"""Host side of the fused query projection: tile choice, launch, compile tracking.

Triton compiles a variant per constexpr set and pointer alignment. Every variant
launched outside CUDA-graph capture is recorded; asking for a new one while the
current stream is capturing raises instead of compiling (which would stall or
break the capture).
"""

from __future__ import annotations

import torch
import triton

from vllm_mla import envs
from vllm_mla.ops.query_projection import MXFP8Weight, QueryProjectionNotPrewarmed
from vllm_mla.ops.triton.query_projection import mla_query_projection_kernel

BLOCK_K = 64
_compiled: set[tuple] = set()


def _tiles(m: int, latent: int, interpret: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_L): tl.dot needs >= 16 rows; the interpreter prefers few programs."""
    block_m = max(16, triton.next_power_of_2(m))
    block_l = latent if interpret else 64
    return block_m, block_l


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def fused_query_projection(args, q_nope, q_pe, out, q_scale) -> None:
    """Launch the kernel on validated, gated arguments (see ops.query_projection)."""
    interpret = envs.triton_interpret()
    block_m, block_l = _tiles(args.m, args.latent, interpret)
    mx = isinstance(args.weight, MXFP8Weight)
    values = args.weight.values if mx else args.weight
    scales = args.weight.scales if mx else values  # unused when not MXFP8
    scale = q_scale if args.fp8_out else q_nope  # unused without FP8 output
    pointers = (q_nope, values, scales, q_pe, out, scale)
    key = (
        q_nope.device,
        out.dtype,
        mx,
        args.p,
        block_m,
        tuple(t.data_ptr() % 16 == 0 for t in pointers),
    )
    if key not in _compiled and _capturing(q_nope.device):
        raise QueryProjectionNotPrewarmed(
            f"fused query projection variant (M bucket {block_m}, P={args.p}, "
            f"{'mxfp8' if mx else 'bf16'} weight, out {out.dtype}) was not compiled before "
            "CUDA-graph capture: call vllm_mla.ops.prewarm(...) for every captured M first"
        )
    grid = (args.h, args.latent // block_l + 1)
    mla_query_projection_kernel[grid](
        q_nope,
        values,
        scales,
        q_pe,
        out,
        scale,
        args.m,
        q_nope.stride(0),
        q_nope.stride(1),
        values.stride(0),
        values.stride(1),
        scales.stride(0),
        scales.stride(1) if mx else 0,
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        P=args.p,
        L=args.latent,
        R=args.rope,
        BLOCK_M=block_m,
        BLOCK_K=BLOCK_K,
        BLOCK_L=block_l,
        MXFP8=mx,
        FP8_OUT=args.fp8_out,
        INTERPRET=interpret,
        num_warps=4,
    )
    _compiled.add(key)


def compiled_variants() -> frozenset[tuple]:
    """Variants launched so far in this process."""
    return frozenset(_compiled)
