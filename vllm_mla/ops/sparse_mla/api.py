"""``sparse_mla_forward``: the public entry, its contract checks, sizing and prewarm.

Validates, allocates what the caller did not pass, resolves the implementation
(``dispatch``) and runs the custom op (``custom_op``), which dispatches again at every
call (under torch.compile only the op runs).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vllm_mla.ops.base import TRITON_AVAILABLE
from vllm_mla.ops.sparse_mla import custom_op, dispatch
from vllm_mla.ops.sparse_mla.dispatch import select_impl as select_impl  # preparation's kernel API
from vllm_mla.ops.sparse_mla.formats import (
    LATENT,
    ROPE,
    SparseMLAError,
    SparseMLATypeError,
    check_format,
    check_rope,
)
from vllm_mla.ops.sparse_mla.validate import Args, Query, validate

# Declared once: Triton on GPU (bf16 operands, fp32 accumulation) vs the fp32 reference.
# Under the interpreter dots are fp32 and only the bf16 output rounding remains.
# out: both sides round to bf16, <= 2 * 2**-8 = 7.8e-3 of the norm; the rest is for the GPU's
# bf16 softmax weights (2**-8 each, random: ~2**-8 / sqrt(3) of the norm unless rows cancel).
OUT_REL_ERR = 1e-2  # ||out - ref|| / ||ref||
# lse: q, k products exact, 576-term fp32 sums in two orders: <= 2 * 576 * 2**-24 * A, A =
# scale * sum|q k| of a row, so 1e-2 holds while A <= 140 (N(0, 1) q and k: A ~ 20).
LSE_ABS_ERR = 1e-2
# With a sink (one more term e^s of the denominator) both hold unchanged: every weight
# shrinks by the same factor Z / (Z + e^s), so out's error and norm scale alike, and the lse
# moves by sum_j w_j dx_j <= max |dx_j| as before, plus the sink logit's own two fp32
# roundings (s log2 e, then ln 2 on the way back): <= 2**-23 |s|, 1e-6 at |s| = 10.


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
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse MLA over physical rows ``indices [T, K]`` -> ``(out [T, H, 512], lse | None)``.

    ``out`` is in q's dtype; ``lse [T, H]`` fp32 natural log (returned when
    ``return_lse`` or an ``lse`` buffer is given). Rows with no valid index: out 0,
    lse -inf. With ``out``, ``lse`` and ``scratch`` (>= ``scratch_bytes``) passed, the
    call allocates nothing (CUDA graphs). An index outside ``[-1, num_blocks * block_size)``
    is an empty slot and, with ``invalid`` (int32 ``[1]``) given, adds 1 to it
    (``formats.INDEX_RULE``, the same in every implementation).

    ``sink`` (fp32 ``[H]``, natural-log logits, unscaled): HY-V4's learnable attention sink,
    one more term per head in the softmax denominator only (``sparse_mla_reference``);
    the lse includes it, and a row with no valid index gets out 0, lse ``sink[h]``.
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
        sink=sink,
    )
    device = args.q_nope.device
    if out is None:
        out = torch.empty(args.num_tokens, args.num_heads, LATENT, dtype=args.dtype, device=device)
    if lse is None and return_lse:
        lse = torch.empty(args.num_tokens, args.num_heads, dtype=torch.float32, device=device)
    if not isinstance(softmax_scale, float | int):
        raise SparseMLATypeError(f"softmax_scale: expected a float, got {type(softmax_scale)}")
    impl = dispatch.resolve(impl, device)
    if scratch is not None and impl == "triton":
        _check_scratch(scratch, args)
    custom_op.sparse_mla_forward_op(
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
        sink,
    )
    return out, lse


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
    with_sink: bool = False,
    rope: int = ROPE,
) -> int:
    """Compile every variant the given token counts need on this cache (call before
    capture); returns how many new variants compiled. Runs on all-empty indices, so the
    cache is only addressed, never read. ``with_sink``: the variants of calls passing a
    ``sink``; ``rope``: the model's qk_rope_head_dim (0: latent-512 MLA without RoPE)."""
    check_rope(rope)
    before = compiled_variants()
    device = kv_cache.device
    for t in sorted(set(token_counts)):
        q = torch.zeros(t, num_heads, LATENT + rope, dtype=q_dtype, device=device)
        idx = torch.full((t, topk), -1, dtype=torch.int32, device=device)
        lengths = torch.zeros(t, dtype=torch.int32, device=device) if with_lengths else None
        sink = torch.zeros(num_heads, dtype=torch.float32, device=device) if with_sink else None
        sparse_mla_forward(
            q,
            kv_cache,
            idx,
            1.0,
            kv_format=kv_format,
            lengths=lengths,
            return_lse=return_lse,
            impl=impl,
            sink=sink,
        )
    return len(compiled_variants() - before)
