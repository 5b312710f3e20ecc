"""Host side of the Triton kernels: tile choice, launch, compile tracking.

Triton compiles a variant per constexpr set and pointer alignment. Every variant
launched outside CUDA-graph capture is recorded; asking for a new one while the
current stream is capturing raises instead of compiling (which would stall or
break the capture).
"""

from __future__ import annotations

import torch
import triton

from vllm_mla import envs
from vllm_mla.ops.base import KernelNotPrewarmed, MXFP8Weight
from vllm_mla.ops.capture import capturing
from vllm_mla.ops.triton.absorbed_bmm import absorbed_bmm_kernel
from vllm_mla.ops.triton.query_projection import mla_query_projection_kernel

BLOCK_K = 64
_compiled: set[tuple] = set()


def _tiles(m: int, latent: int, interpret: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_L): tl.dot needs >= 16 rows; the interpreter prefers few programs."""
    block_m = max(16, triton.next_power_of_2(m))
    block_l = latent if interpret else 64
    return block_m, block_l


def _check_compiled(key: tuple, device: torch.device, what: str) -> None:
    """Raise instead of compiling a new variant while the stream is being captured."""
    if key not in _compiled and capturing(device):
        raise KernelNotPrewarmed(
            f"{what} was not compiled before CUDA-graph capture: run every captured M "
            "once outside capture first (vllm_mla.ops.prewarm / a warm-up step)"
        )


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
    _check_compiled(
        key,
        q_nope.device,
        f"fused query projection variant (M bucket {block_m}, P={args.p}, "
        f"{'mxfp8' if mx else 'bf16'} weight, out {out.dtype})",
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


def _bmm_tiles(m: int, n: int, k: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): tl.dot needs >= 16 on every side."""
    if interpret:  # few, large programs: the interpreter's cost is per program
        return max(16, triton.next_power_of_2(min(m, 64))), triton.next_power_of_2(n), 32
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return block_m, 64, 64 if k % 64 == 0 else 32


def absorbed_bmm(a: torch.Tensor, values: torch.Tensor, scales, out: torch.Tensor) -> None:
    """Launch ``out = a @ W`` on validated operands (see ops.absorbed_bmm).

    ``scales`` is None for a dense W; otherwise its shape says the block axis.
    """
    if out.numel() == 0:
        return  # B, M or N is 0 (no tile to launch; N = 0 would make a 0-wide tile)
    interpret = envs.triton_interpret()
    batch, m, k = a.shape
    n = values.shape[2]
    block_m, block_n, block_k = _bmm_tiles(m, n, k, interpret)
    mx = scales is not None
    along_k = mx and scales.shape[1] != k
    s = scales if mx else values  # unused when dense
    key = (
        "absorbed_bmm",
        a.device,
        a.dtype,
        values.dtype,
        out.dtype,
        mx,
        along_k,
        n,
        k,
        block_m,
        tuple(t.data_ptr() % 16 == 0 for t in (a, values, s, out)),
    )
    _check_compiled(key, a.device, f"absorbed bmm variant (M bucket {block_m}, K={k}, N={n})")
    grid = (batch, triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    absorbed_bmm_kernel[grid](
        a,
        values,
        s,
        out,
        m,
        *a.stride(),
        *values.stride(),
        *(s.stride() if mx else (0, 0, 0)),
        *out.stride(),
        N=n,
        K=k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        MXFP8=mx,
        SCALE_ALONG_K=along_k,
        FP32_IN=a.dtype == torch.float32,
        OUT_BF16=out.dtype == torch.bfloat16,
        INTERPRET=interpret,
        num_warps=4,
    )
    _compiled.add(key)


def compiled_variants() -> frozenset[tuple]:
    """Variants launched so far in this process."""
    return frozenset(_compiled)
