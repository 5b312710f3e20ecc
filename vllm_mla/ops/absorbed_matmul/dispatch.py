"""The absorbed BMM's one dispatcher: which path a weight takes, and running it.

Paths (``plan_path``): ``triton`` (MXFP8 on CUDA, or on CPU under ``TRITON_INTERPRET=1``),
``torch-mxfp8`` (CPU MXFP8, chunked decode), ``safe`` (dense bf16 on CUDA: the bounds-safe
query BMM op) and ``torch`` (other dense dtypes; on CPU every dense weight). Entries:
``run`` (the custom ops' body) and ``run_checked`` (an ``AbsorbedWeight``'s eager bmm), each
one hop from the launch.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable

import torch

import vllm_mla.ops.query_bmm  # noqa: F401  (registers vllm_mla::safe_mla_query_bmm)
from vllm_mla import envs
from vllm_mla.ops.absorbed_matmul.api import fail, validate
from vllm_mla.ops.absorbed_matmul.reference import torch_mxfp8
from vllm_mla.ops.base import TRITON_AVAILABLE, MXFP8Weight

PATHS = ("triton", "torch-mxfp8", "safe", "torch")

_calls: Counter[tuple[str, str]] = Counter()


def calls() -> dict[str, int]:
    """Absorbed BMMs served in this process, per ``path:role`` (``plan_path``'s names)."""
    return {f"{path}:{role}" if role else path: n for (path, role), n in _calls.items()}


def reset_calls() -> None:
    """Forget the counts (tests)."""
    _calls.clear()


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


Runner = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", torch.Tensor], None]


def runner(path: str, device_type: str) -> Runner:
    """The function that runs ``path`` (from ``plan_path``) on ``device_type``: a kernel's
    launch itself where there is one (Triton is imported only when a weight plans it)."""
    if path in ("safe", "torch"):
        if device_type != "cuda":
            return _run_cpu_dense
        return _run_safe_cuda if path == "safe" else _run_dense
    if path == "triton":
        from vllm_mla.ops.absorbed_matmul import kernel  # Triton is optional

        return kernel.launch
    return torch_mxfp8


def run(
    a: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    out: torch.Tensor,
    role: str = "",
    path: str = "",
) -> None:
    """Run ``out = a @ W`` on ``path`` (default: ``plan_path``'s) and count it."""
    path = path or plan_path(values, scales, a.dtype)
    runner(path, a.device.type)(a, values, scales, out)
    _calls[path, role] += 1


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
        fail(f"a must be {dtype}, got {a.dtype}")  # the one check validate leaves out
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
