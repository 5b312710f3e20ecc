"""The one place sparse MLA picks and runs an implementation (b12x, Triton, reference).

Both entries reach a launch through :func:`run`, in three hops: the library call
(``sparse_mla_forward`` -> the custom op -> ``run`` -> ``LaunchSite.launch``) and the
engine's decode step (``forward_mqa`` -> ``BoundCall.run`` -> ``run`` -> ``LaunchSite.launch``).

Implementations (:func:`select_impl`):

- ``b12x``: b12x's SM120/121 kernels. b12x needs a prepared plan bound to caller-owned
  scratch (plan -> prepare/freeze -> bind -> run), which is the backend's lifecycle, so
  the backend registers a runner with :func:`register_b12x_runner`; chosen only when b12x
  imports, reports the device supported, the device is SM120/121 and a runner is
  registered. A call the runner does not serve runs on Triton.
- ``triton``: the portable split-K Triton kernels (CUDA SM80+; on CPU only under
  ``TRITON_INTERPRET=1`` and only when asked for explicitly).
- ``reference``: plain torch (the CPU default).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable

import torch

from vllm_mla.ops.base import TRITON_AVAILABLE, triton_gpu, triton_runs_on
from vllm_mla.ops.sparse_mla.formats import SparseMLAError
from vllm_mla.ops.sparse_mla.reference import sparse_mla_reference

IMPLS = ("auto", "b12x", "triton", "reference")
B12X_CAPABILITIES = ((12, 0), (12, 1))
NO_DCP_ARGS = (1, 0, 1)  # DCPShard.args of a rank without decode context parallelism

B12XRunner = Callable[..., bool]
_b12x_runner: B12XRunner | None = None


def register_b12x_runner(runner: B12XRunner | None) -> None:
    """Install (or clear, with None) the b12x runner.

    Called as ``runner(q_nope, q_pe, kv_cache, indices, lengths, out, lse, scratch,
    softmax_scale=..., kv_format=..., invalid=..., sink=...)`` with validated tensors
    (``invalid``: the ``INDEX_RULE`` counter or None; ``sink``: fp32 ``[H]`` attention-sink
    logits or None); it must write ``out`` (and ``lse`` when not None),
    allocate nothing while a graph is captured and return True, or return False without
    writing for a call it does not serve (Triton runs).
    """
    global _b12x_runner
    _b12x_runner = runner


def b12x_runner() -> B12XRunner | None:
    """The registered b12x runner, or None."""
    return _b12x_runner


@functools.cache
def _b12x_module():
    if importlib.util.find_spec("b12x") is None:
        return None
    try:
        return importlib.import_module("b12x.attention.sparse_mla")
    except ImportError:
        return None


def _b12x_usable(device: torch.device) -> bool:
    module = _b12x_module()
    if _b12x_runner is None or module is None:
        return False
    if torch.cuda.get_device_capability(device) not in B12X_CAPABILITIES:
        return False
    return bool(module.is_supported(device))


def select_impl(device: torch.device | str) -> str:
    """``"b12x"`` | ``"triton"`` | ``"reference"`` for tensors on ``device`` (module doc)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "reference"
    if _b12x_usable(device):
        return "b12x"
    if triton_gpu(device):
        return "triton"
    return "reference"


def resolve(impl: str, device: torch.device) -> str:
    """``impl`` (one of ``IMPLS``) made concrete for ``device``; an error names why a forced
    implementation cannot run there."""
    if impl not in IMPLS:
        raise SparseMLAError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return select_impl(device)
    if impl == "triton":
        on_device = triton_runs_on(device)
        if not (TRITON_AVAILABLE and on_device):
            raise NotImplementedError(
                f"impl='triton' needs Triton and a CUDA device (or TRITON_INTERPRET=1 for CPU "
                f"tensors); got device {device}, triton installed: {TRITON_AVAILABLE}"
            )
    if impl == "b12x" and (device.type != "cuda" or not _b12x_usable(device)):
        raise NotImplementedError(
            "impl='b12x' needs b12x installed (b12x.attention.sparse_mla), an SM120/121 "
            f"CUDA device and register_b12x_runner(...); device {device}"
        )
    return impl


def run(
    impl: str,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    *,
    softmax_scale: float,
    kv_format: str,
    lengths: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    invalid: torch.Tensor | None = None,
    site=None,
    req_id: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    dcp: tuple[int, int, int] = NO_DCP_ARGS,
    sink: torch.Tensor | None = None,
) -> bool:
    """Write ``out`` (and ``lse``) with the resolved ``impl`` on validated arguments.

    ``site``: the caller's ``triton_kernels.LaunchSite`` (a bound call's), else the cached
    one of this cache and call shape. ``req_id``/``block_table``/``dcp``: logical top-k
    positions (Triton only; see ``LaunchSite.launch``). ``sink``: fp32 ``[H]`` per-head
    sink logits (``sparse_mla_reference``'s contract) or None. Returns True when Triton
    compiled a variant new to the process.
    """
    runner = _b12x_runner
    if (
        impl == "b12x"
        and runner is not None
        and runner(
            q_nope,
            q_pe,
            kv_cache,
            indices,
            lengths,
            out,
            lse,
            scratch,
            softmax_scale=softmax_scale,
            kv_format=kv_format,
            invalid=invalid,
            sink=sink,
        )
    ):
        return False
    if impl in ("triton", "b12x"):  # b12x: a call its runner does not serve
        from vllm_mla.ops.sparse_mla import triton_kernels  # Triton is optional

        if site is None:
            site = triton_kernels.site_for(
                kv_cache,
                q_nope.shape[1],
                indices.shape[1],
                kv_format,
                softmax_scale,
                q_nope.dtype,
                rope=q_pe.shape[-1],
            )
        if lengths is not None and lengths.stride(0) != 1:
            # The kernel reads lengths[t] at len_ptr + t (a stride argument costs sm120 a
            # larger frame); a strided [T] view is rare enough to copy (T int32s).
            lengths = lengths.contiguous()
        return site.launch(
            q_nope,
            q_pe,
            kv_cache,
            indices,
            out,
            scratch,
            lengths,
            lse,
            invalid,
            req_id=req_id,
            block_table=block_table,
            dcp=dcp,
            sink=sink,
        )
    ref_out, ref_lse = sparse_mla_reference(
        (q_nope, q_pe),
        kv_cache,
        indices,
        softmax_scale,
        kv_format=kv_format,
        lengths=lengths,
        invalid=invalid,
        sink=sink,
    )
    out.copy_(ref_out)
    if lse is not None:
        lse.copy_(ref_lse)
    return False
