"""The kpool indexer's Triton kernel (CUDA SM80+): pool compression, and its launch.

One program per pool: the softmax(gate + ape)-weighted mean over the pool's ``kpool``
slots in fp32, bf16, the Hadamard-128 butterflies in fp32, bf16 (``reference.
compress_pools``). The bf16 roundings are done on the bits (``triton_bits.round_to_bf16``,
the interpreter's own cast rounds unlike a GPU's). Registers only: one 128-wide fp32
vector per operand, no shared memory beyond the butterflies' shuffles (well under the
~99 KiB of SM12x). Launched on validated arguments only (``custom_op``); the pool cache
write, logits and top-k are the V3.2 indexer's kernels (``ops.sparse_indexer``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_mla.formats import INDEX_HEAD_DIM
from vllm_mla.ops.kpool_indexer.reference import HADAMARD_SCALE
from vllm_mla.ops.triton_bits import round_to_bf16

# |kernel - reference| per element <= one bf16 ulp of the element: the fp32 math is the
# reference's operation by operation (same slot order, same butterflies), except exp,
# whose libm / GPU approximation differs by a few fp32 ulps; that moves the fp32 result
# by ~1e-6 relative, which changes a bf16 rounding (of the pool mean or the rotated
# value) only at a rounding boundary, by one bf16 ulp (2**-8 relative); the rotation of
# a one-ulp change in the mean moves each output by <= 2**-8 * |mean|_max * sqrt(128)/128.
COMPRESS_RTOL = 2.0**-7
NUM_WARPS = 4
_HADAMARD_SCALE = tl.constexpr(HADAMARD_SCALE)


@triton.jit
def _butterfly(x, GROUPS: tl.constexpr, STRIDE: tl.constexpr):
    x3 = tl.reshape(x, (GROUPS, 2, STRIDE))
    x3 = tl.trans(x3, 0, 2, 1)
    a, b = tl.split(x3)
    x3 = tl.join(a + b, a - b)
    x3 = tl.trans(x3, 0, 2, 1)
    return tl.reshape(x3, (GROUPS * 2 * STRIDE,))


@triton.jit
def _hadamard128(x):
    x = _butterfly(x, 64, 1)
    x = _butterfly(x, 32, 2)
    x = _butterfly(x, 16, 4)
    x = _butterfly(x, 8, 8)
    x = _butterfly(x, 4, 16)
    x = _butterfly(x, 2, 32)
    x = _butterfly(x, 1, 64)
    return x * _HADAMARD_SCALE


@triton.jit
def _compress_pools_kernel(
    k_ptr,
    gate_ptr,
    ape_ptr,
    out_ptr,
    s_kp,
    s_ks,
    s_gp,
    s_gs,
    s_as,
    s_op,
    KPOOL: tl.constexpr,
    D: tl.constexpr,
):
    pool = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, D)
    peak = tl.full((D,), float("-inf"), tl.float32)
    for s in tl.static_range(KPOOL):
        g = tl.load(gate_ptr + pool * s_gp + s * s_gs + offs).to(tl.float32)
        peak = tl.maximum(peak, g + tl.load(ape_ptr + s * s_as + offs))
    acc = tl.zeros((D,), tl.float32)
    denom = tl.zeros((D,), tl.float32)
    for s in tl.static_range(KPOOL):
        g = tl.load(gate_ptr + pool * s_gp + s * s_gs + offs).to(tl.float32)
        prob = tl.exp(g + tl.load(ape_ptr + s * s_as + offs) - peak)
        denom = denom + prob
        k = tl.load(k_ptr + pool * s_kp + s * s_ks + offs).to(tl.float32)
        acc = acc + k * prob
    x = round_to_bf16(acc / denom).to(tl.float32)
    y = round_to_bf16(_hadamard128(x))
    tl.store(out_ptr + pool * s_op + offs, y)


def launch_compress_pools(k, gate, ape, out) -> None:
    """``out [P, 128]`` bf16 from ``k/gate [P, kpool, 128]``, ``ape [kpool, 128]`` fp32
    (validated, unit last strides; P > 0)."""
    p, kpool, _ = k.shape
    _compress_pools_kernel[(p,)](
        k,
        gate,
        ape,
        out,
        k.stride(0),
        k.stride(1),
        gate.stride(0),
        gate.stride(1),
        ape.stride(0),
        out.stride(0),
        KPOOL=kpool,
        D=INDEX_HEAD_DIM,
        num_warps=NUM_WARPS,
    )


__all__ = ["COMPRESS_RTOL", "launch_compress_pools"]
