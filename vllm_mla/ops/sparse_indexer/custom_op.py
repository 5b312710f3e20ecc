"""The indexer's custom ops (``vllm_mla::indexer_insert_keys``, ``_paged_logits``,
``_select_topk``): validated at every call, fake impls registered, grids and temporaries
fixed by shapes and no host sync, so each can be captured in a CUDA graph."""

from __future__ import annotations

import torch

from vllm_mla.ops.sparse_indexer import triton_kernels as kernels
from vllm_mla.ops.sparse_indexer.reference import INDEX_HEAD_DIM
from vllm_mla.ops.sparse_indexer.validate import check_pages, check_runnable, expect


@torch.library.custom_op("vllm_mla::indexer_insert_keys", mutates_args=("cache",))
def _insert_keys_op(cache: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, ue8m0: bool) -> None:
    check_pages(cache)
    floats = (torch.bfloat16, torch.float16, torch.float32)
    expect("k", k.dtype in floats, f"dtype in {floats}", k.dtype)
    expect("slots", slots.dtype in (torch.int32, torch.int64), "int32 or int64", slots.dtype)
    expect("slots", slots.dim() == 1 and slots.stride(0) == 1, "a contiguous [T]", slots.shape)
    t = slots.shape[0]
    expect("k", k.shape == (t, INDEX_HEAD_DIM), f"shape ({t}, {INDEX_HEAD_DIM})", tuple(k.shape))
    check_runnable(cache, k, slots)
    if t == 0:
        return
    kernels.launch_insert_keys(cache, k, slots, ue8m0)


@_insert_keys_op.register_fake
def _(cache, k, slots, ue8m0):
    return None


@torch.library.custom_op("vllm_mla::indexer_paged_logits", mutates_args=("out",))
def _paged_logits_op(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
) -> None:
    check_pages(cache)
    q_dtypes = (torch.float8_e4m3fn, torch.bfloat16)
    expect("q", q.dtype in q_dtypes, f"dtype in {q_dtypes}", q.dtype)
    shape_ok = q.dim() == 3 and q.shape[-1] == INDEX_HEAD_DIM and q.stride(-1) == 1
    expect("q", shape_ok, f"[T, H, {INDEX_HEAD_DIM}] with unit last stride", tuple(q.shape))
    t, h, _ = q.shape
    s = out.shape[-1] if out.dim() == 2 else -1
    for name, x, dtype, shape in (
        ("weights", weights, torch.float32, (t, h)),
        ("lengths", lengths, torch.int32, (t,)),
        ("out", out, torch.float32, (t, s)),
    ):
        expect(name, x.dtype == dtype, f"dtype {dtype}", x.dtype)
        expect(name, tuple(x.shape) == shape and x.stride(-1) == 1, f"contiguous {shape}", x.shape)
    expect("block_tables", block_tables.dtype == torch.int32, "dtype int32", block_tables.dtype)
    bt_ok = block_tables.dim() == 2 and block_tables.shape[0] == t and block_tables.stride(1) == 1
    expect("block_tables", bt_ok, f"contiguous [T={t}, W]", tuple(block_tables.shape))
    check_runnable(q, weights, cache, block_tables, lengths, out)
    if t == 0 or s == 0:
        return
    kernels.launch_paged_logits(q, weights, cache, block_tables, lengths, out)


@_paged_logits_op.register_fake
def _(q, weights, cache, block_tables, lengths, out):
    return None


@torch.library.custom_op("vllm_mla::indexer_select_topk", mutates_args=("out",))
def _select_topk_op(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor) -> None:
    ok = scores.dim() == 2 and scores.is_floating_point()
    expect("scores", ok, "floating [T, S]", (scores.dtype, tuple(scores.shape)))
    t = scores.shape[0]
    int_ok = lengths.dtype in (torch.int32, torch.int64) and tuple(lengths.shape) == (t,)
    expect("lengths", int_ok, f"int32/int64 shape ({t},)", (lengths.dtype, tuple(lengths.shape)))
    out_ok = out.dtype == torch.int32 and out.dim() == 2 and out.shape[0] == t
    expect("out", out_ok, f"int32 [T={t}, topk]", (out.dtype, tuple(out.shape)))
    expect("device", lengths.device == out.device == scores.device, scores.device, out.device)
    kernels.topk_into(scores, lengths, out)


@_select_topk_op.register_fake
def _(scores, lengths, out):
    return None
