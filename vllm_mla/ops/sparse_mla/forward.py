"""Sparse MLA entry point: validate, pick an implementation, run as one custom op.

``sparse_mla_forward`` runs as ``torch.ops.vllm_mla.sparse_mla_forward`` (fake impl
registered; mutates ``out``, ``lse``, ``scratch``), so torch.compile and CUDA graphs
see one opaque op. Implementations (``select_impl``):

- ``b12x``: b12x's SM120/121 kernels. b12x needs a prepared plan bound to caller-owned
  scratch (plan -> prepare/freeze -> bind -> run), which is the
  backend's lifecycle, so the backend registers a runner with ``register_b12x_runner``;
  it is chosen only when b12x imports, reports the device supported, the device is
  SM120/121 and a runner is registered. Not exercised here (b12x is not installed).
- ``triton``: the portable split-K Triton kernels (CUDA SM80+; on CPU only under
  ``TRITON_INTERPRET=1`` and only when asked for explicitly).
- ``reference``: plain torch (the CPU default).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterable

import torch

from vllm_mla import envs
from vllm_mla.ops.base import TRITON_AVAILABLE
from vllm_mla.ops.sparse_mla.formats import (
    LATENT,
    SparseMLAError,
    SparseMLATypeError,
    check_format,
)
from vllm_mla.ops.sparse_mla.reference import sparse_mla_reference
from vllm_mla.ops.sparse_mla.validate import Args, Query, validate

IMPLS = ("auto", "b12x", "triton", "reference")
B12X_CAPABILITIES = ((12, 0), (12, 1))
TRITON_MIN_CAPABILITY = (8, 0)
# Declared once: Triton on GPU (bf16 operands, fp32 accumulation) vs the fp32 reference.
# Under the interpreter dots are fp32 and only the bf16 output rounding remains.
# out: both sides round to bf16, <= 2 * 2**-8 = 7.8e-3 of the norm; the rest is for the GPU's
# bf16 softmax weights (2**-8 each, random: ~2**-8 / sqrt(3) of the norm unless rows cancel).
OUT_REL_ERR = 1e-2  # ||out - ref|| / ||ref||
# lse: q, k products exact, 576-term fp32 sums in two orders: <= 2 * 576 * 2**-24 * A, A =
# scale * sum|q k| of a row, so 1e-2 holds while A <= 140 (N(0, 1) q and k: A ~ 20).
LSE_ABS_ERR = 1e-2

B12XRunner = Callable[..., bool]
_b12x_runner: B12XRunner | None = None


def register_b12x_runner(runner: B12XRunner | None) -> None:
    """Install (or clear, with None) the b12x runner.

    Called as ``runner(q_nope, q_pe, kv_cache, indices, lengths, out, lse, scratch,
    softmax_scale=..., kv_format=..., invalid=...)`` with validated tensors (``invalid``:
    the ``INDEX_RULE`` counter or None); it must write ``out``
    (and ``lse`` when not None), allocate nothing while a graph is captured and return
    True, or return False without writing for a call it does not serve (Triton runs).
    """
    global _b12x_runner
    _b12x_runner = runner


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
    """``"b12x"`` | ``"triton"`` | ``"reference"`` for tensors on ``device`` (see module doc)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "reference"
    if _b12x_usable(device):
        return "b12x"
    if TRITON_AVAILABLE and torch.cuda.get_device_capability(device) >= TRITON_MIN_CAPABILITY:
        return "triton"
    return "reference"


def _resolve(impl: str, device: torch.device) -> str:
    if impl not in IMPLS:
        raise SparseMLAError(f"impl: expected one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return select_impl(device)
    if impl == "triton":
        on_device = device.type == "cuda" or (device.type == "cpu" and envs.triton_interpret())
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


def scratch_bytes(num_tokens: int, num_heads: int, topk: int, *, kv_format: str) -> int:
    """Bytes of uint8 ``scratch`` that serve every call with T <= num_tokens, these heads
    and top-k <= topk (0 when no call of that size splits). Pass it 16-byte aligned."""
    check_format(kv_format)
    for name, v in (("num_tokens", num_tokens), ("num_heads", num_heads), ("topk", topk)):
        if v < 1:
            raise SparseMLAError(f"{name}: expected >= 1, got {v}")
    if not TRITON_AVAILABLE:
        return 0
    from vllm_mla.ops.sparse_mla import triton_kernels as kernels

    return kernels.scratch_bytes(num_tokens, num_heads, topk)


def _check_scratch(scratch: torch.Tensor, args: Args) -> None:
    if scratch.dtype != torch.uint8:
        raise SparseMLATypeError(f"scratch: expected dtype torch.uint8, got {scratch.dtype}")
    if scratch.dim() != 1 or scratch.stride(0) != 1:
        raise SparseMLAError(
            f"scratch: expected a contiguous 1-D tensor, got shape {tuple(scratch.shape)}"
        )
    if scratch.data_ptr() % 16:
        raise SparseMLAError(f"scratch: expected a 16-byte aligned start, got {scratch.data_ptr()}")
    if scratch.device != args.q_nope.device:
        raise SparseMLAError(f"scratch: expected device {args.q_nope.device}, got {scratch.device}")
    from vllm_mla.ops.sparse_mla import triton_kernels as kernels

    need = kernels.split_plan(args.num_tokens, args.num_heads, args.topk).layout()[2]
    if scratch.numel() < need:
        raise SparseMLAError(
            f"scratch: expected >= {need} bytes for T={args.num_tokens}, H={args.num_heads}, "
            f"K={args.topk} (see scratch_bytes), got {scratch.numel()}"
        )


def sparse_mla_forward(
    q: Query,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    kv_format: str,
    lengths: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    return_lse: bool = False,
    lse: torch.Tensor | None = None,
    invalid: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA over physical rows ``indices [T, K]`` -> ``(out [T, H, 512], lse | None)``.

    ``out`` is in q's dtype; ``lse [T, H]`` fp32 natural log (returned when
    ``return_lse`` or an ``lse`` buffer is given). Rows with no valid index: out 0,
    lse -inf. With ``out``, ``lse`` and ``scratch`` (>= ``scratch_bytes``) passed, the
    call allocates nothing (CUDA graphs). An index outside ``[-1, num_blocks * block_size)``
    is an empty slot and, with ``invalid`` (int32 ``[1]``) given, adds 1 to it
    (``formats.INDEX_RULE``, the same in every implementation).
    """
    args = validate(
        q,
        kv_cache,
        indices,
        kv_format=kv_format,
        lengths=lengths,
        out=out,
        lse=lse,
        invalid=invalid,
    )
    device = args.q_nope.device
    if out is None:
        out = torch.empty(args.num_tokens, args.num_heads, LATENT, dtype=args.dtype, device=device)
    if lse is None and return_lse:
        lse = torch.empty(args.num_tokens, args.num_heads, dtype=torch.float32, device=device)
    if not isinstance(softmax_scale, float | int):
        raise SparseMLATypeError(f"softmax_scale: expected a float, got {type(softmax_scale)}")
    impl = _resolve(impl, device)
    if scratch is not None and impl == "triton":
        _check_scratch(scratch, args)
    torch.ops.vllm_mla.sparse_mla_forward(
        args.q_nope,
        args.q_pe,
        kv_cache,
        indices,
        lengths,
        out,
        lse,
        scratch,
        invalid,
        float(softmax_scale),
        kv_format,
        impl,
    )
    return out, lse


@torch.library.custom_op(
    "vllm_mla::sparse_mla_forward", mutates_args=("out", "lse", "scratch", "invalid")
)
def _sparse_mla_op(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scratch: torch.Tensor | None,
    invalid: torch.Tensor | None,
    softmax_scale: float,
    kv_format: str,
    impl: str,
) -> None:
    # Validated again on purpose: under torch.compile the wrapper's checks run at trace
    # time only, and this op is what runs at every call (the decode step uses neither:
    # it goes through preparation.BoundCall).
    args = validate(
        (q_nope, q_pe),
        kv_cache,
        indices,
        kv_format=kv_format,
        lengths=lengths,
        out=out,
        lse=lse,
        invalid=invalid,
    )
    impl = _resolve(impl, q_nope.device)
    runner = _b12x_runner
    served = (
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
        )
    )
    if served:
        return
    if impl in ("triton", "b12x"):  # b12x: a call its runner does not serve
        from vllm_mla.ops.sparse_mla import triton_kernels as kernels

        kernels.launch(
            args, kv_cache, indices, lengths, out, lse, scratch, softmax_scale, kv_format, invalid
        )
    else:
        ref_out, ref_lse = sparse_mla_reference(
            (q_nope, q_pe),
            kv_cache,
            indices,
            softmax_scale,
            kv_format=kv_format,
            lengths=lengths,
            invalid=invalid,
        )
        out.copy_(ref_out)
        if lse is not None:
            lse.copy_(ref_lse)


@_sparse_mla_op.register_fake
def _(q_nope, q_pe, kv_cache, indices, lengths, out, lse, scratch, invalid, scale, fmt, impl):
    return None


def compiled_variants() -> frozenset[tuple]:
    """Triton variants compiled so far (empty without Triton); unchanged after a freeze."""
    if not TRITON_AVAILABLE:
        return frozenset()
    from vllm_mla.ops.sparse_mla import triton_kernels as kernels

    return kernels.compiled_variants()


def prewarm(
    kv_cache: torch.Tensor,
    *,
    num_heads: int,
    topk: int,
    kv_format: str,
    token_counts: Iterable[int],
    q_dtype: torch.dtype = torch.bfloat16,
    with_lengths: bool = False,
    return_lse: bool = False,
    impl: str = "auto",
) -> int:
    """Compile every variant the given token counts need on this cache (call before
    capture); returns how many new variants compiled. Runs on all-empty indices, so the
    cache is only addressed, never read."""
    before = compiled_variants()
    device = kv_cache.device
    for t in sorted(set(token_counts)):
        q = torch.zeros(t, num_heads, LATENT + 64, dtype=q_dtype, device=device)
        idx = torch.full((t, topk), -1, dtype=torch.int32, device=device)
        lengths = torch.zeros(t, dtype=torch.int32, device=device) if with_lengths else None
        sparse_mla_forward(
            q,
            kv_cache,
            idx,
            1.0,
            kv_format=kv_format,
            lengths=lengths,
            return_lse=return_lse,
            impl=impl,
        )
    return len(compiled_variants() - before)
