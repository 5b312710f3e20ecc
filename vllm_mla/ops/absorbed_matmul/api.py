"""Absorbed-weight BMM ``out[b] = a[b] @ W[b]``, W dense or an MXFP8 view of a pack: the
public API and its contract.

Contract:

- ``a [B, M, K]`` (bf16, fp16 or fp32; any strides), ``W [B, K, N]``, ``out [B, M, N]``
  in ``a``'s dtype (any strides; it must not overlap an input, nor itself: no stride-0
  dim).
- ``W`` is a dense tensor in ``a``'s dtype, or an ``MXFP8Weight``: e4m3 ``values
  [B, K, N]`` (any strides) and uint8 E8M0 ``scales`` with one code per 32 elements
  along K (``[B, K/32, N]``, as W_UV ``[H, L, V]`` reads kv_b_proj's pack) or along N
  (``[B, K, N/32]``, as W_UK_T ``[H, P, L]`` does). MXFP8 takes bf16 or fp32 ``a``.
- Every weight element is decoded exactly (e4m3 x 2**k fits BF16), products are summed
  in fp32 and rounded once to ``out``'s dtype: the same function as a bmm against the
  dequantized pair, up to summation order.

Paths (``dispatch``; one per call, counted in ``calls()``): ``triton`` (MXFP8 on CUDA, or on
CPU under ``TRITON_INTERPRET=1``: values and scales read in place, no BF16 copy); ``safe``
(dense bf16: ``safe_mla_query_bmm``, bounds-safe on SM12x); ``torch`` (other dense dtypes,
or a dense weight routed only to carry the fused query projection: upstream's
``torch.bmm``); ``torch-mxfp8`` (CPU MXFP8: decode a few heads at a time, then bmm). A
weight may fix its path at construction (``path=``); otherwise ``plan_path`` picks it from
the weight. All run as ``torch.ops.vllm_mla.absorbed_bmm_out`` (mutates ``out``) or
``absorbed_bmm`` (functional), with fake impls, so torch.compile and CUDA graphs see opaque
ops.

Row layout (``row_width`` W > N): the functional form returns ``[B, M, N]`` as a view of a
``[M, B, W]`` buffer (strides ``(W, B * W, 1)``), so the caller's ``.transpose(0, 1)`` is the
left part of a contiguous ``[M, B, W]`` tensor whose right part the caller fills (the DSA
query, ``query_fusion.row_query``). Values are those of the plain layout.
"""

from __future__ import annotations

import torch

from vllm_mla.ops import overlap
from vllm_mla.ops.base import MXFP8Weight
from vllm_mla.quant import mxfp8

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MXFP8_ACT_DTYPES = (torch.bfloat16, torch.float32)
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


Weight = torch.Tensor | MXFP8Weight


class AbsorbedBmmError(ValueError):
    """Operands of the absorbed BMM do not fit its contract; the message names the one."""


def fail(message: str) -> None:
    raise AbsorbedBmmError(f"absorbed_bmm: {message}")


def scales_along_k(values: torch.Tensor, scales: torch.Tensor) -> bool:
    """True for ``[B, K/32, N]`` scales (blocks along K), False for ``[B, K, N/32]``."""
    b, k, n = values.shape
    block = mxfp8.BLOCK_SIZE
    if k % block == 0 and tuple(scales.shape) == (b, k // block, n):
        return True
    if n % block == 0 and tuple(scales.shape) == (b, k, n // block):
        return False
    fail(
        f"weight.scales shape {tuple(scales.shape)} fits neither blocks along K "
        f"({(b, k // block, n)}) nor along N ({(b, k, n // block)}) for values "
        f"{tuple(values.shape)}"
    )
    raise AssertionError  # unreachable


def as_uint8(scales: torch.Tensor) -> torch.Tensor:
    return scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)


def validate(a: torch.Tensor, weight: Weight, out: torch.Tensor | None) -> None:
    """Raise AbsorbedBmmError (naming the operand) unless the call fits the contract."""
    if not isinstance(a, torch.Tensor) or a.dim() != 3 or a.dtype not in ACT_DTYPES:
        fail(f"a must be a 3-D [B, M, K] tensor in {ACT_DTYPES}, got {_describe(a)}")
    mx = isinstance(weight, MXFP8Weight)
    values = weight.values if mx else weight
    if not isinstance(values, torch.Tensor) or values.dim() != 3:
        fail(f"weight must be 3-D [B, K, N], got {_describe(values)}")
    if mx:
        if values.dtype != torch.float8_e4m3fn:
            fail(f"weight.values must be torch.float8_e4m3fn, got {values.dtype}")
        scales = weight.scales
        if not isinstance(scales, torch.Tensor) or scales.dtype not in SCALE_DTYPES:
            fail(f"weight.scales must be a tensor in {SCALE_DTYPES}, got {_describe(scales)}")
        if a.dtype not in MXFP8_ACT_DTYPES:
            fail(f"an MXFP8 weight takes a in {MXFP8_ACT_DTYPES}, got {a.dtype}")
        scales_along_k(values, weight.scales)
    elif values.dtype != a.dtype:
        fail(f"weight dtype {values.dtype} differs from a's {a.dtype}")
    batch, m, k = a.shape
    if tuple(values.shape[:2]) != (batch, k):
        fail(
            f"weight shape {tuple(values.shape)} does not fit a {tuple(a.shape)}: expected "
            f"[B={batch}, K={k}, N]"
        )
    tensors = [("weight", values)] + ([("weight.scales", weight.scales)] if mx else [])
    if out is not None:
        want = (batch, m, values.shape[2])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != a.dtype:
            fail(f"out must be {want} {a.dtype}, got {_describe(out)}")
        tensors.append(("out", out))
    for name, t in tensors:
        if t.device != a.device:
            fail(f"{name} is on {t.device} but a is on {a.device}")
    problem = None if out is None else overlap.out_problem(out, [("a", a), *tensors[:-1]])
    if problem is not None:
        fail(problem)


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}"


def parts(weight: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (weight.values, weight.scales) if isinstance(weight, MXFP8Weight) else (weight, None)


def absorbed_bmm(
    a: torch.Tensor, weight: Weight, out: torch.Tensor | None = None, *, role: str = ""
) -> torch.Tensor:
    """``a @ W`` batched over B, into ``out`` when given (returned), else a new tensor.

    ``role`` (e.g. ``W_UK_T``) only labels the call in ``calls()``. Raises
    AbsorbedBmmError naming the operand when the call does not fit the contract.
    """
    validate(a, weight, out)
    values, scales = parts(weight)
    if out is None:
        return torch.ops.vllm_mla.absorbed_bmm(a, values, scales, role)
    torch.ops.vllm_mla.absorbed_bmm_out(a, values, scales, out, role)
    return out


def mla_v_projection(x: torch.Tensor, weight: Weight, out: torch.Tensor) -> torch.Tensor:
    """MLA's V up-projection ``out[t, h] = x[t, h] @ W_UV[h]``: x ``[T, H, L]``, out ``[T, H, V]``.

    ``weight`` is ``[H, L, V]``: BF16, or an ``MXFP8Weight`` with scales ``[H, L/32, V]``
    (a view of the pack's scales). fp32 accumulation, one rounding to ``out``'s dtype.
    """
    if not (isinstance(x, torch.Tensor) and x.dim() == 3):
        fail(f"x must be 3-D [T, H, L], got {_describe(x)}")
    if not (isinstance(out, torch.Tensor) and out.dim() == 3):
        fail(f"out must be 3-D [T, H, V], got {_describe(out)}")
    absorbed_bmm(x.transpose(0, 1), weight, out.transpose(0, 1), role="W_UV")
    return out
