"""Absorbed-weight BMM: ``out[b] = a[b] @ W[b]`` with W dense or an MXFP8 view of a pack.

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

Paths (one per call, counted in ``calls()``): ``triton`` (MXFP8 on CUDA, or on CPU under
``TRITON_INTERPRET=1``: values and scales read in place, no BF16 copy); ``safe`` (dense
bf16: ``safe_mla_query_bmm``, bounds-safe on SM12x); ``torch`` (other dense dtypes, or a
dense weight routed only to carry the fused query projection: upstream's ``torch.bmm``);
``torch-mxfp8`` (CPU MXFP8: decode a few heads at a time, then bmm). A weight may fix its
path at construction (``path=``); otherwise ``plan_path`` picks it from the weight. All
run as ``torch.ops.vllm_mla.absorbed_bmm_out`` (mutates ``out``) or ``absorbed_bmm``
(functional), with fake impls, so torch.compile and CUDA graphs see opaque ops.

Row layout (``row_width`` W > N): the functional form returns ``[B, M, N]`` as a view of a
``[M, B, W]`` buffer (strides ``(W, B * W, 1)``), so the caller's ``.transpose(0, 1)`` is the
left part of a contiguous ``[M, B, W]`` tensor whose right part the caller fills (the DSA
query, ``query_fusion.row_query``). Values are those of the plain layout.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable

import torch

import vllm_mla.ops.query_bmm  # noqa: F401  (registers vllm_mla::safe_mla_query_bmm)
from vllm_mla import envs
from vllm_mla.ops import overlap
from vllm_mla.ops.base import TRITON_AVAILABLE, MXFP8Weight
from vllm_mla.quant import mxfp8

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MXFP8_ACT_DTYPES = (torch.bfloat16, torch.float32)
SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)
DECODE_SCRATCH_BYTES = 8 << 20  # bound on the torch path's decoded weight chunk

_calls: Counter[tuple[str, str]] = Counter()

Weight = torch.Tensor | MXFP8Weight


class AbsorbedBmmError(ValueError):
    """Operands of the absorbed BMM do not fit its contract; the message names the one."""


def calls() -> dict[str, int]:
    """Absorbed BMMs served in this process, per ``path:role`` (``plan_path``'s names)."""
    return {f"{path}:{role}" if role else path: n for (path, role), n in _calls.items()}


def reset_calls() -> None:
    """Forget the counts (tests)."""
    _calls.clear()


def _fail(message: str) -> None:
    raise AbsorbedBmmError(f"absorbed_bmm: {message}")


def scales_along_k(values: torch.Tensor, scales: torch.Tensor) -> bool:
    """True for ``[B, K/32, N]`` scales (blocks along K), False for ``[B, K, N/32]``."""
    b, k, n = values.shape
    block = mxfp8.BLOCK_SIZE
    if k % block == 0 and tuple(scales.shape) == (b, k // block, n):
        return True
    if n % block == 0 and tuple(scales.shape) == (b, k, n // block):
        return False
    _fail(
        f"weight.scales shape {tuple(scales.shape)} fits neither blocks along K "
        f"({(b, k // block, n)}) nor along N ({(b, k, n // block)}) for values "
        f"{tuple(values.shape)}"
    )
    raise AssertionError  # unreachable


def _as_uint8(scales: torch.Tensor) -> torch.Tensor:
    return scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)


def validate(a: torch.Tensor, weight: Weight, out: torch.Tensor | None) -> None:
    """Raise AbsorbedBmmError (naming the operand) unless the call fits the contract."""
    if not isinstance(a, torch.Tensor) or a.dim() != 3 or a.dtype not in ACT_DTYPES:
        _fail(f"a must be a 3-D [B, M, K] tensor in {ACT_DTYPES}, got {_describe(a)}")
    mx = isinstance(weight, MXFP8Weight)
    values = weight.values if mx else weight
    if not isinstance(values, torch.Tensor) or values.dim() != 3:
        _fail(f"weight must be 3-D [B, K, N], got {_describe(values)}")
    if mx:
        if values.dtype != torch.float8_e4m3fn:
            _fail(f"weight.values must be torch.float8_e4m3fn, got {values.dtype}")
        scales = weight.scales
        if not isinstance(scales, torch.Tensor) or scales.dtype not in SCALE_DTYPES:
            _fail(f"weight.scales must be a tensor in {SCALE_DTYPES}, got {_describe(scales)}")
        if a.dtype not in MXFP8_ACT_DTYPES:
            _fail(f"an MXFP8 weight takes a in {MXFP8_ACT_DTYPES}, got {a.dtype}")
        scales_along_k(values, weight.scales)
    elif values.dtype != a.dtype:
        _fail(f"weight dtype {values.dtype} differs from a's {a.dtype}")
    batch, m, k = a.shape
    if tuple(values.shape[:2]) != (batch, k):
        _fail(
            f"weight shape {tuple(values.shape)} does not fit a {tuple(a.shape)}: expected "
            f"[B={batch}, K={k}, N]"
        )
    tensors = [("weight", values)] + ([("weight.scales", weight.scales)] if mx else [])
    if out is not None:
        want = (batch, m, values.shape[2])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != a.dtype:
            _fail(f"out must be {want} {a.dtype}, got {_describe(out)}")
        tensors.append(("out", out))
    for name, t in tensors:
        if t.device != a.device:
            _fail(f"{name} is on {t.device} but a is on {a.device}")
    problem = None if out is None else overlap.out_problem(out, [("a", a), *tensors[:-1]])
    if problem is not None:
        _fail(problem)


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}"


def decode(weight: MXFP8Weight, dtype: torch.dtype, heads: slice = slice(None)) -> torch.Tensor:
    """The dense ``[B, K, N]`` values of ``weight[heads]`` in ``dtype`` (exact for bf16/fp32)."""
    values, scales = weight.values[heads], _as_uint8(weight.scales[heads])
    axis = 1 if scales_along_k(values, scales) else 2
    code = mxfp8.decode_scales(scales).repeat_interleave(mxfp8.BLOCK_SIZE, dim=axis)
    return (values.to(torch.float32) * code).to(dtype)


def reference(a: torch.Tensor, weight: Weight) -> torch.Tensor:
    """The contract in plain torch: fp32 products and sums, rounded once to ``a``'s dtype."""
    w = decode(weight, torch.float32) if isinstance(weight, MXFP8Weight) else weight.float()
    return torch.bmm(a.float(), w).to(a.dtype)


def _torch_mxfp8(a: torch.Tensor, weight: MXFP8Weight, out: torch.Tensor) -> None:
    # fp32 products and sums, one rounding into out: the contract, on any CPU
    batch, _, k = a.shape
    per_head = k * weight.values.shape[2] * 4
    step = max(1, DECODE_SCRATCH_BYTES // max(per_head, 1))
    for h in range(0, batch, step):
        heads = slice(h, min(h + step, batch))
        w = decode(weight, torch.float32, heads)
        out[heads].copy_(torch.bmm(a[heads].float(), w))


PATHS = ("triton", "torch-mxfp8", "safe", "torch")


def plan_path(values: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> str:
    """The path every call with this weight takes (it depends only on the weight)."""
    device = values.device
    if scales is not None:
        interpret = device.type == "cpu" and envs.triton_interpret()
        return (
            "triton"
            if TRITON_AVAILABLE and (device.type == "cuda" or interpret)
            else ("torch-mxfp8")
        )
    if dtype == torch.bfloat16 and values.stride(-1) == 1:
        return "safe"
    return "torch"


def _run_safe_cuda(a, values, scales, out) -> None:
    if a.stride(-1) != 1:
        a = a.contiguous()  # the op takes any strides but a contiguous last dim
    if out.stride(-1) == 1:
        torch.ops.vllm_mla.safe_mla_query_bmm(a, values, out)
    else:
        _dense_fallback(a, values, out)


def _run_dense(a, values, scales, out) -> None:
    _dense_fallback(a, values, out)


def _run_cpu_dense(a, values, scales, out) -> None:
    # CPU has no over-read: the safe op's CPU kernel is torch.bmm (no dispatcher trip)
    torch.bmm(a, values, out=out)


def _run_triton(a, values, scales, out) -> None:
    from vllm_mla.ops.triton import launch

    launch.absorbed_bmm(a, values, _as_uint8(scales), out)


def _run_torch_mxfp8(a, values, scales, out) -> None:
    _torch_mxfp8(a, MXFP8Weight(values, scales), out)


Runner = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor], None]


def runner(path: str, device_type: str) -> Runner:
    """The function that runs ``path`` (from ``plan_path``) on ``device_type``."""
    if path in ("safe", "torch"):
        if device_type != "cuda":
            return _run_cpu_dense
        return _run_safe_cuda if path == "safe" else _run_dense
    return _run_triton if path == "triton" else _run_torch_mxfp8


def run_path(
    path: str,
    a: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    out: torch.Tensor,
    role: str,
) -> None:
    """Run ``out = a @ W`` on ``path`` (from ``plan_path``) and count it."""
    runner(path, a.device.type)(a, values, scales, out)
    _calls[path, role] += 1


def _run(
    a: torch.Tensor, values: torch.Tensor, scales, out: torch.Tensor, role: str, path: str = ""
) -> None:
    run_path(path or plan_path(values, scales, a.dtype), a, values, scales, out, role)


def new_out(a: torch.Tensor, n: int, row_width: int = 0) -> torch.Tensor:
    """``[B, M, N]`` for ``a [B, M, K]``: contiguous, or (``row_width`` W > 0) a view of a new
    ``[M, B, W]`` buffer, strides ``(W, B * W, 1)`` (the module docstring's row layout)."""
    batch, m = a.shape[0], a.shape[1]
    if row_width:
        return a.new_empty((m, batch, row_width)).transpose(0, 1)[..., :n]
    return a.new_empty((batch, m, n))


def run_checked(w, a: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Eager entry for ``w``, an ``AbsorbedWeight`` validated once at construction.

    Checks only what a call can change (a's shape, dtype and device, ``out``), in a few
    comparisons; a mismatch gets the full validation's message. Runs the weight's
    precomputed path directly, without the dispatcher (the custom ops are for tracing).
    """
    batch, k, n, device, dtype = w._dims
    shape = a.shape
    ok = (
        len(shape) == 3
        and shape[0] == batch
        and shape[2] == k
        and a.dtype is dtype
        and a.get_device() == device
    )
    if ok and out is not None:
        o = out.shape
        ok = out.dtype is dtype and o[0] == batch and o[1] == shape[1] and o[2] == n
    values, scales = w._values, w._scales
    if not ok:
        validate(a, values if scales is None else MXFP8Weight(values, scales), out)
        _fail(f"a must be {dtype}, got {a.dtype}")  # the one check validate leaves out
    if out is None:
        if w._run is _run_cpu_dense and not w._row_width:
            _calls[w._key] += 1
            return torch.bmm(a, values)  # CPU: torch allocates the result itself
        out = new_out(a, n, w._row_width)
    w._run(a, values, scales, out)
    _calls[w._key] += 1
    return out


def _dense_fallback(a: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    if a.is_cuda and _is_sm12x(a.get_device()):
        # cuBLAS on SM12x over-reads strided operands; contiguous ones are safe.
        a, values = a.contiguous(), values.contiguous()
    torch.bmm(a, values, out=out)  # a strided out is computed aside and copied in


@functools.cache
def _is_sm12x(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 12


@torch.library.custom_op("vllm_mla::absorbed_bmm_out", mutates_args=("out",))
def _bmm_out_op(
    a: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    out: torch.Tensor,
    role: str = "",
    path: str = "",
) -> None:
    _run(a, values, scales, out, role, path)


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
    out = new_out(a, values.shape[2], row_width)
    _run(a, values, scales, out, role, path)
    return out


@_bmm_op.register_fake
def _(a, values, scales, role="", path="", row_width=0):
    return new_out(a, values.shape[2], row_width)


def _parts(weight: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (weight.values, weight.scales) if isinstance(weight, MXFP8Weight) else (weight, None)


def absorbed_bmm(
    a: torch.Tensor, weight: Weight, out: torch.Tensor | None = None, *, role: str = ""
) -> torch.Tensor:
    """``a @ W`` batched over B, into ``out`` when given (returned), else a new tensor.

    ``role`` (e.g. ``W_UK_T``) only labels the call in ``calls()``. Raises
    AbsorbedBmmError naming the operand when the call does not fit the contract.
    """
    validate(a, weight, out)
    values, scales = _parts(weight)
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
        _fail(f"x must be 3-D [T, H, L], got {_describe(x)}")
    if not (isinstance(out, torch.Tensor) and out.dim() == 3):
        _fail(f"out must be 3-D [T, H, V], got {_describe(out)}")
    absorbed_bmm(x.transpose(0, 1), weight, out.transpose(0, 1), role="W_UV")
    return out
