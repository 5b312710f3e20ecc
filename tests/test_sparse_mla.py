"""Sparse MLA: Triton split-K kernels (interpreted on CPU) against the torch reference."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_mla import envs
from vllm_mla.ops import sparse_mla as sm
from vllm_mla.ops.sparse_mla import (
    KV_FORMATS,
    SparseMLAError,
    SparseMLANotPrepared,
    SparseMLATypeError,
    dispatch,
    pack_rows,
    scratch_bytes,
    select_impl,
    sparse_mla_forward,
    sparse_mla_reference,
)

pytest.importorskip("triton")
from aot import assert_fits, compile_report
from error_bounds import sparse_mla_bound

from vllm_mla.ops.sparse_mla import triton_kernels as kernels

SCALE = 1 / math.sqrt(192 + 64)  # GLM-5's qk head dim


def make_cache(fmt, num_blocks=5, block_size=16, *, seed=0):
    """A cache whose pages interleave with a poisoned neighbour page (dim-0 stride is two
    pages): a row read from the wrong place turns the result into NaN."""
    gen = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size
    # Binary grids: eighths times a power of two per row, the first of each 128-group at
    # 7/8 of it (fp8 group scales are powers of two, e4m3 codes exact). With make_q's
    # quarters every dot is exact in fp32 in any order (error_bounds.exact_dots), so the
    # tolerance is the softmax's own rounding, not a dot's summation order.
    kv_c = torch.randint(-7, 8, (n, 512), generator=gen) / 8
    kv_c[:, ::128] = 7 / 8
    kv_c *= torch.exp2(torch.randint(-2, 2, (n, 1), generator=gen).float())
    k_pe = torch.randint(-8, 9, (n, 64), generator=gen) / 8
    packed = pack_rows(kv_c, k_pe, fmt)
    if packed.dtype == torch.uint8:  # 0xFF: an e4m3 NaN (scale or value), an fp32 NaN
        big = torch.full((num_blocks, 2, block_size, packed.shape[1]), 0xFF, dtype=torch.uint8)
    else:
        big = torch.full((num_blocks, 2, block_size, 576), float("nan"), dtype=torch.bfloat16)
    big[:, 0] = packed.view(num_blocks, block_size, -1)
    cache = big[:, 0]
    assert cache.stride(0) == 2 * block_size * cache.shape[-1]
    return cache


def make_indices(t, k, num_rows, *, seed=0, empty=0.2):
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, num_rows, (t, k), generator=gen, dtype=torch.int32)
    idx[0, 0] = num_rows - 1  # the very last row of the cache
    idx[torch.rand(t, k, generator=gen) < empty] = -1
    return idx


def make_q(t, h, *, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed + 2)
    return (torch.randint(-8, 9, (t, h, 576), generator=gen) / 4).to(dtype)  # quarters


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    _, exponent = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def assert_matches(out, lse, ref, ref_lse, bound):
    """Interpreter dots are fp32, so only the summation orders differ from the reference:
    out within ``bound`` (``sparse_mla_bound``: worst case of any two orders, any CPU) plus
    one bf16 ulp (each side rounds once, <= half an ulp), lse within its bound; empty rows
    exactly (0, -inf)."""
    out_tol, lse_tol = bound
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.float().isnan().any()
    got, want = out.double(), ref.double()
    tol = out_tol + (
        bf16_ulp(torch.maximum(got.abs(), want.abs())) if out.dtype != torch.float32 else 0
    )
    assert ((got - want).abs() <= tol).all(), ((got - want).abs() - tol).max()
    if lse is not None:
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert ((lse[finite].double() - ref_lse[finite]).abs() <= lse_tol[finite]).all()
        assert (out.float()[~finite] == 0).all()


def bound_of(q, cache, idx, fmt, lengths=None):
    return sparse_mla_bound(q, cache, idx, SCALE, fmt, lengths)


def run_both(q, cache, idx, fmt, lengths=None, **kw):
    """(out, lse, ref, ref_lse, bound): Triton, the reference, their error bound."""
    out, lse = sparse_mla_forward(
        q, cache, idx, SCALE, kv_format=fmt, lengths=lengths, return_lse=True, impl="triton", **kw
    )
    ref, ref_lse = sparse_mla_reference(q, cache, idx, SCALE, kv_format=fmt, lengths=lengths)
    return out, lse, ref, ref_lse, bound_of(q, cache, idx, fmt, lengths)


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("h", [1, 3, 8, 16, 20, 64])
@pytest.mark.parametrize("t", [1, 5])
def test_matches_reference(fmt, h, t):
    """K=70 is not a multiple of BLOCK_K=32; T=5 adds ragged lengths (0, short, > K);
    H=20 is one masked 32-head tile, H=64 two full ones."""
    cache = make_cache(fmt)
    k = 70
    idx = make_indices(t, k, cache.shape[0] * cache.shape[1], seed=h)
    lengths = None
    if t == 5:
        lengths = torch.tensor([70, 33, 0, 1, 500], dtype=torch.int32)
    q = make_q(t, h, seed=h)
    plan = kernels.split_plan(t, h, k)
    assert plan.num_splits == 3 and not plan.direct  # 3 chunks, one per split
    out, lse, ref, ref_lse, bound = run_both(q, cache, idx, fmt, lengths)
    assert_matches(out, lse, ref, ref_lse, bound)
    if lengths is not None:
        assert torch.isinf(lse[2]).all() and (out[2] == 0).all()


def test_head_tiles_read_each_gathered_row_once_up_to_32_heads():
    """The kernel's own byte accounting: K records per token while H <= 32 (one program
    holds every head), then one read per 32-head tile (not per 16)."""
    rec = sm.record_bytes("fp8_ds_mla")
    assert [kernels.block_h(h) for h in (1, 16, 17, 32, 64, 128)] == [16, 16, 32, 32, 32, 32]
    for h in (1, 8, 16, 20, 32):
        assert kernels.gathered_bytes(h, 2048, "fp8_ds_mla") == 2048 * rec
    assert kernels.gathered_bytes(64, 2048, "fp8_ds_mla") == 2 * 2048 * rec
    assert kernels.gathered_bytes(128, 2048, "fp8_ds_mla") == 4 * 2048 * rec  # was 8x


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_direct_path_with_several_chunks(fmt, monkeypatch):
    """One split (the extend shape): the split kernel loops over chunks and writes out."""
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 1)
    monkeypatch.setattr(kernels, "_sites", {})  # cached sites keep their split plans
    cache = make_cache(fmt)
    t, h, k = 2, 3, 75
    assert kernels.split_plan(t, h, k).direct
    idx = make_indices(t, k, cache.shape[0] * cache.shape[1])
    out, lse, ref, ref_lse, bound = run_both(make_q(t, h), cache, idx, fmt)
    assert_matches(out, lse, ref, ref_lse, bound)
    out2, none = sparse_mla_forward(make_q(t, h), cache, idx, SCALE, kv_format=fmt, impl="triton")
    assert none is None and torch.equal(out2, out)


def test_splits_with_several_chunks_each(monkeypatch):
    monkeypatch.setattr(kernels, "MAX_SPLITS", 2)
    cache = make_cache("bf16")
    t, h, k = 2, 3, 150  # 5 chunks -> 2 splits of 3 chunks (96 rows), the last one short
    plan = kernels.split_plan(t, h, k)
    assert (plan.num_splits, plan.split_len) == (2, 96)
    idx = make_indices(t, k, cache.shape[0] * cache.shape[1])
    out, lse, ref, ref_lse, bound = run_both(make_q(t, h), cache, idx, "bf16")
    assert_matches(out, lse, ref, ref_lse, bound)


@pytest.mark.parametrize("direct", [False, True])
def test_rows_without_valid_index(direct, monkeypatch):
    if direct:
        monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 1)
    monkeypatch.setattr(kernels, "_sites", {})  # cached sites keep their split plans
    assert kernels.split_plan(3, 2, 40).direct == direct
    cache = make_cache("fp8_ds_mla")
    idx = make_indices(3, 40, cache.shape[0] * cache.shape[1])
    idx[0] = -1
    lengths = torch.tensor([40, 0, 40], dtype=torch.int32)
    out, lse, ref, ref_lse, bound = run_both(make_q(3, 2), cache, idx, "fp8_ds_mla", lengths)
    assert_matches(out, lse, ref, ref_lse, bound)
    assert (out[:2] == 0).all() and torch.isneginf(lse[:2]).all()
    assert torch.isfinite(lse[2]).all()


def test_tuple_q_with_strided_nope_and_fp32():
    """vLLM passes q_nope as a non-contiguous view; fp32 q gives fp32 out."""
    t, h = 3, 5
    cache = make_cache("bf16")
    gen = torch.Generator().manual_seed(7)
    # quarters, like make_q: exact dots in any order, so the strided and the contiguous q
    # below give equal fp32 scores whatever kernel each layout gets (ref2 bit-exact)
    q_nope = (torch.randint(-8, 9, (h, t, 544), generator=gen) / 4).transpose(0, 1)[..., 16:528]
    q_pe = (torch.randint(-8, 9, (t, h, 2, 64), generator=gen) / 4)[:, :, 1]
    assert not q_nope.is_contiguous() and not q_pe.is_contiguous()
    idx = make_indices(t, 50, cache.shape[0] * cache.shape[1])
    out, lse, ref, ref_lse, bound = run_both((q_nope, q_pe), cache, idx, "bf16")
    assert out.dtype == torch.float32
    assert_matches(out, lse, ref, ref_lse, bound)
    full = torch.cat([q_nope, q_pe], dim=-1)
    ref2, _ = sparse_mla_reference(full, cache, idx, SCALE, kv_format="bf16")
    assert torch.equal(ref, ref2)


def test_reference_against_dense_softmax():
    """The oracle itself, on one hand-built row: duplicates count twice, -1 and rows past
    lengths are ignored."""
    cache = make_cache("bf16", num_blocks=2, block_size=4)
    q = make_q(1, 2, dtype=torch.float32)
    idx = torch.tensor([[3, -1, 5, 3, 7, 0]], dtype=torch.int32)
    lengths = torch.tensor([5], dtype=torch.int32)
    out, lse = sparse_mla_reference(q, cache, idx, 0.1, kv_format="bf16", lengths=lengths)
    rows = cache.reshape(-1, 576)[[3, 5, 3, 7]].float()
    s = q[0] @ rows.T * 0.1
    # fp32 both, einsum vs matmul: two summation orders, bounded from the arithmetic
    out_tol, lse_tol = sparse_mla_bound(q, cache, idx, 0.1, "bf16", lengths)
    assert ((lse[0].double() - torch.logsumexp(s, -1)).abs() <= lse_tol[0]).all()
    assert ((out[0].double() - torch.softmax(s, -1) @ rows[:, :512]).abs() <= out_tol[0]).all()


def test_scratch_serves_every_smaller_call():
    n, h, k = 40, 16, 2048
    need = scratch_bytes(n, h, k, kv_format="fp8_ds_mla")
    sizes = [
        kernels.split_plan(t, hh, kk).layout()[2]
        for t in range(1, n + 1)
        for hh in range(1, h + 1)
        for kk in range(1, k + 1, 37)
    ]
    assert need >= max(sizes) > 0


@pytest.mark.parametrize(
    ("t", "h", "k", "smaller"),
    [(1, 5, 544, (1, 5, 500)), (7, 128, 256, (7, 128, 200)), (3, 17, 300, (3, 16, 300))],
)
def test_scratch_covers_the_calls_that_broke_it(t, h, k, smaller):
    # exact split counts jump with K (9 -> 16 splits) and drop with more heads
    assert kernels.split_plan(*smaller).layout()[2] <= scratch_bytes(t, h, k, kv_format="bf16")


def test_scratch_is_monotone_in_tokens_heads_and_topk():
    ts, hs, ks = (1, 2, 3, 5, 8, 17), (1, 3, 5, 16, 17, 64, 128), (1, 31, 64, 200, 500, 544, 2048)
    grid = {(t, h, k): scratch_bytes(t, h, k, kv_format="bf16") for t in ts for h in hs for k in ks}
    for (t, h, k), need in grid.items():
        for dt, dh, dk in ((1, 0, 0), (0, 1, 0), (0, 0, 1)):
            i, j, m = ts.index(t) + dt, hs.index(h) + dh, ks.index(k) + dk
            if i < len(ts) and j < len(hs) and m < len(ks):
                assert grid[ts[i], hs[j], ks[m]] >= need, ((t, h, k), (ts[i], hs[j], ks[m]))
    assert scratch_bytes(4096, 64, 2048, kv_format="bf16") == scratch_bytes(
        300, 64, 2048, kv_format="bf16"
    )
    assert kernels.split_plan(32, 16, 2048) == kernels.SplitPlan(32, 16, 8, 256)
    assert kernels.split_plan(4096, 64, 2048).direct


def test_caller_scratch_is_used(monkeypatch):
    cache = make_cache("bf16")
    t, h, k = 2, 3, 70
    idx = make_indices(t, k, cache.shape[0] * cache.shape[1])
    scratch = torch.zeros(scratch_bytes(t, h, k, kv_format="bf16") + 16, dtype=torch.uint8)
    allocs = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: allocs.append(a) or real_empty(*a, **kw))
    out = real_empty(t, h, 512, dtype=torch.bfloat16)
    lse = real_empty(t, h)
    sparse_mla_forward(
        make_q(t, h),
        cache,
        idx,
        SCALE,
        kv_format="bf16",
        out=out,
        lse=lse,
        scratch=scratch,
        impl="triton",
    )
    assert allocs == [] and scratch[:-16].any() and not scratch[-16:].any()
    monkeypatch.undo()
    ref, ref_lse = sparse_mla_reference(make_q(t, h), cache, idx, SCALE, kv_format="bf16")
    assert_matches(out, lse, ref, ref_lse, bound_of(make_q(t, h), cache, idx, "bf16"))
    with pytest.raises(SparseMLAError, match="scratch: expected >= "):
        sparse_mla_forward(
            make_q(t, h), cache, idx, SCALE, kv_format="bf16", scratch=scratch[:100], impl="triton"
        )
    with pytest.raises(SparseMLAError, match="scratch: expected a 16-byte aligned"):
        sparse_mla_forward(
            make_q(t, h), cache, idx, SCALE, kv_format="bf16", scratch=scratch[1:], impl="triton"
        )
    with pytest.raises(SparseMLATypeError, match=r"scratch: expected dtype torch\.uint8"):
        sparse_mla_forward(
            make_q(t, h),
            cache,
            idx,
            SCALE,
            kv_format="bf16",
            scratch=scratch.view(torch.int32),
            impl="triton",
        )


def test_prewarm_then_capture_refuses_new_variants(monkeypatch):
    monkeypatch.setattr(kernels, "_compiled", set())
    cache = make_cache("fp8_ds_mla")
    # T=1 splits, T=4096 would not: two variants (the big one is run on all-empty rows).
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 8)
    monkeypatch.setattr(kernels, "_sites", {})  # cached sites keep their split plans
    warmed = sm.prewarm(
        cache, num_heads=2, topk=40, kv_format="fp8_ds_mla", token_counts=[1, 2, 8], impl="triton"
    )
    assert warmed == 2 and len(sm.compiled_variants()) == 2
    monkeypatch.setattr(kernels, "capturing", lambda device: True)
    idx = make_indices(2, 40, cache.shape[0] * cache.shape[1])
    sparse_mla_forward(make_q(2, 2), cache, idx, SCALE, kv_format="fp8_ds_mla", impl="triton")
    with pytest.raises(SparseMLANotPrepared, match="lse=True"):
        sparse_mla_forward(
            make_q(2, 2),
            cache,
            idx,
            SCALE,
            kv_format="fp8_ds_mla",
            return_lse=True,
            impl="triton",
        )
    with pytest.raises(SparseMLANotPrepared, match="bf16"):
        sparse_mla_forward(
            make_q(2, 2), make_cache("bf16"), idx, SCALE, kv_format="bf16", impl="triton"
        )


def good_args(t=2, h=2, k=8, fmt="bf16"):
    cache = make_cache(fmt, num_blocks=2, block_size=8)
    return {
        "q": make_q(t, h),
        "kv_cache": cache,
        "indices": make_indices(t, k, 16),
        "softmax_scale": SCALE,
        "kv_format": fmt,
    }


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"q": torch.randn(2, 2, 576).half()}, SparseMLATypeError, "q: expected dtype"),
        ({"q": torch.randn(2, 2, 575).bfloat16()}, SparseMLAError, "q: expected shape"),
        ({"q": torch.randn(2, 0, 576).bfloat16()}, SparseMLAError, "expected H >= 1"),
        ({"q": (torch.randn(2, 2, 512),)}, SparseMLAError, "q: expected a \\(q_nope, q_pe\\)"),
        (
            {"q": (torch.randn(2, 2, 512), torch.randn(2, 3, 64))},
            SparseMLAError,
            "q_pe: expected shape \\[2, 2, 64\\]",
        ),
        (
            {"q": (torch.randn(2, 2, 512), torch.randn(2, 2, 64).bfloat16())},
            SparseMLATypeError,
            "q_pe: expected dtype torch.float32",
        ),
        (
            {"q": (torch.randn(2, 2, 1024)[..., ::2], torch.randn(2, 2, 64))},
            SparseMLAError,
            "q_nope: last dim must be contiguous",
        ),
        ({"kv_format": "fp8"}, SparseMLAError, "kv_format: expected one of"),
        ({"kv_format": "fp8_ds_mla"}, SparseMLATypeError, "expects dtype torch.uint8"),
        (
            {"kv_format": "fp8_ds_mla", "kv_cache": torch.zeros(2, 8, 576, dtype=torch.uint8)},
            SparseMLAError,
            "expects \\[num_blocks, block_size, 656\\]",
        ),
        (
            {"kv_cache": torch.zeros(2, 8, 1152, dtype=torch.bfloat16)[..., ::2]},
            SparseMLAError,
            "kv_cache: last dim must be contiguous",
        ),
        ({"kv_cache": torch.zeros(0, 8, 576).bfloat16()}, SparseMLAError, "non-empty cache"),
        (
            {"indices": torch.zeros(2, 8, dtype=torch.int64)},
            SparseMLATypeError,
            "indices: expected dtype torch.int32",
        ),
        (
            {"indices": torch.zeros(3, 8, dtype=torch.int32)},
            SparseMLAError,
            "indices: expected shape \\[2, \\*\\]",
        ),
        ({"indices": torch.zeros(2, 0, dtype=torch.int32)}, SparseMLAError, "K >= 1"),
        (
            {"lengths": torch.zeros(2, dtype=torch.int64)},
            SparseMLATypeError,
            "lengths: expected dtype",
        ),
        (
            {"lengths": torch.zeros(3, dtype=torch.int32)},
            SparseMLAError,
            "lengths: expected shape \\[2\\]",
        ),
        (
            {"out": torch.empty(2, 2, 576).bfloat16()},
            SparseMLAError,
            "out: expected shape \\[2, 2, 512\\]",
        ),
        ({"out": torch.empty(2, 2, 512)}, SparseMLATypeError, "out: expected dtype torch.bfloat16"),
        ({"lse": torch.empty(2, 2).bfloat16()}, SparseMLATypeError, "lse: expected dtype"),
        ({"lse": torch.empty(2, 4)[:, ::2]}, SparseMLAError, "lse: last dim must be contiguous"),
        (
            {"out": torch.empty(1, 2, 512).bfloat16().expand(2, 2, 512)},
            SparseMLAError,
            "out: expected distinct memory per element",
        ),
        (
            {"lse": torch.empty(1, 2).expand(2, 2)},
            SparseMLAError,
            "lse: expected distinct memory per element",
        ),
        (
            {"indices": torch.zeros(2, 8, dtype=torch.int32, device="meta")},
            SparseMLAError,
            "indices: expected device cpu",
        ),
        (
            {"softmax_scale": torch.tensor(1.0)},
            SparseMLATypeError,
            "softmax_scale: expected a float",
        ),
        ({"impl": "cuda"}, SparseMLAError, "impl: expected one of"),
        ({"impl": "b12x"}, NotImplementedError, "impl='b12x' needs b12x"),
    ],
)
def test_bad_input_names_the_argument(change, exc, match):
    args = {**good_args(), **change}
    with pytest.raises(exc, match=match):
        sparse_mla_forward(**args)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(envs, "triton_interpret", lambda: False)
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        sparse_mla_forward(**good_args(), impl="triton")


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_out_of_range_indices_are_empty_and_counted(impl, fmt):
    """INDEX_RULE in every implementation: an index outside [-1, rows) is an empty slot
    (the cache's poisoned neighbour pages would turn a stray read into NaN) and is counted;
    entries past ``lengths`` are ignored, not counted."""
    cache = make_cache(fmt, num_blocks=2, block_size=8)  # 16 rows
    idx = make_indices(3, 40, 16)
    bad = [(0, 3, 16), (1, 0, 17), (1, 9, 1 << 20), (2, 5, -2), (2, 6, -(1 << 30))]
    for t, j, v in bad:
        idx[t, j] = v
    lengths = torch.tensor([40, 40, 39], dtype=torch.int32)
    idx[2, 39] = 999  # past lengths[2]: ignored, not counted
    invalid = torch.zeros(1, dtype=torch.int32)
    q = make_q(3, 2)
    out, lse = sparse_mla_forward(
        q,
        cache,
        idx,
        SCALE,
        kv_format=fmt,
        lengths=lengths,
        return_lse=True,
        invalid=invalid,
        impl=impl,
    )
    assert int(invalid) == len(bad)
    clean = idx.clone()
    for t, j, _ in bad:
        clean[t, j] = -1
    want, want_lse = sparse_mla_reference(q, cache, clean, SCALE, kv_format=fmt, lengths=lengths)
    assert torch.isfinite(out.float()).all()
    assert_matches(out, lse, want, want_lse, bound_of(q, cache, clean, fmt, lengths))
    # without a counter the rule is the same, only nothing is counted
    again, _ = sparse_mla_forward(q, cache, idx, SCALE, kv_format=fmt, lengths=lengths, impl=impl)
    assert torch.equal(again, out)


def test_invalid_must_be_an_int32_counter():
    args = good_args()
    with pytest.raises(SparseMLATypeError, match=r"invalid: expected dtype torch\.int32"):
        sparse_mla_forward(**args, invalid=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(SparseMLAError, match=r"invalid: expected shape \[1\]"):
        sparse_mla_forward(**args, invalid=torch.zeros(2, dtype=torch.int32))


def fake_cuda(monkeypatch, capability, *, b12x=None, supported=True, runner=True):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    module = None
    if b12x:
        module = type("B12X", (), {"is_supported": staticmethod(lambda device: supported)})
    monkeypatch.setattr(dispatch, "_b12x_module", lambda: module)
    monkeypatch.setattr(dispatch, "_b12x_runner", (lambda *a, **k: None) if runner else None)


@pytest.mark.parametrize(
    ("capability", "b12x", "supported", "runner", "want"),
    [
        ((12, 0), True, True, True, "b12x"),
        ((12, 1), True, True, True, "b12x"),
        ((12, 0), True, False, True, "triton"),  # b12x says no
        ((12, 0), True, True, False, "triton"),  # no runner registered by the backend
        ((12, 0), False, True, True, "triton"),  # not installed
        ((10, 0), True, True, True, "triton"),  # b12x only on SM120/121
        ((9, 0), False, True, True, "triton"),
        ((8, 0), False, True, True, "triton"),
        ((7, 5), False, True, True, "reference"),
    ],
)
def test_select_impl(monkeypatch, capability, b12x, supported, runner, want):
    fake_cuda(monkeypatch, capability, b12x=b12x, supported=supported, runner=runner)
    assert select_impl("cuda") == want
    assert select_impl("cpu") == "reference"


def test_auto_on_cpu_runs_the_reference_and_b12x_gets_validated_tensors(monkeypatch):
    calls = []

    class Site:  # the Triton launch a call the b12x runner declines falls back to
        def launch(self, *args, **kwargs):
            calls.append("triton")

    monkeypatch.setattr(kernels, "site_for", lambda *a, **k: Site())
    args = good_args()
    out, lse = sparse_mla_forward(**args, return_lse=True)
    assert calls == []
    ref, ref_lse = sparse_mla_reference(**args)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    got = {}
    monkeypatch.setattr(dispatch, "resolve", lambda impl, device: "b12x")
    monkeypatch.setattr(dispatch, "_b12x_runner", lambda *a, **k: got.update(args=a, kw=k))
    sparse_mla_forward(**args)
    q_nope, q_pe = got["args"][:2]
    assert q_nope.shape == (2, 2, 512) and q_pe.shape == (2, 2, 64)
    want = {"softmax_scale": SCALE, "kv_format": "bf16", "invalid": None, "sink": None}
    assert got["kw"] == want
    assert calls == ["triton"]  # the runner returned a falsy value: not served


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_custom_op_passes_opcheck(impl):
    cache = make_cache("fp8_ds_mla", num_blocks=2, block_size=8)
    t, h = 2, 1
    q = make_q(t, h)
    idx = make_indices(t, 16, 16)
    out = torch.empty(t, h, 512, dtype=torch.bfloat16)
    lse = torch.empty(t, h)
    lengths = torch.tensor([16, 3], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.vllm_mla.sparse_mla_forward,
        (
            q[..., :512],
            q[..., 512:],
            cache,
            idx,
            lengths,
            out,
            lse,
            None,
            torch.zeros(1, dtype=torch.int32),
            SCALE,
            "fp8_ds_mla",
            impl,
        ),
        test_utils=(
            "test_schema",
            "test_autograd_registration",
            "test_faketensor",
            "test_aot_dispatch_dynamic",
        ),
    )


AOT_SCRIPT = r"""
import json, sys
from aot import cubin_usage
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_mla.ops.sparse_mla import triton_kernels as k

INTS = ["m_off", "l_off", "T", "H", "K", "split_len", "block_size", "num_rows"]
STRIDES = ["s_qn_t", "s_qn_h", "s_qp_t", "s_qp_h", "s_kv_b", "s_kv_t", "s_idx", "s_o_t",
           "s_o_h", "s_lse_t"]
ALIGNED = {"s_bt", "H", "block_size", "s_qn_t", "s_qn_h", "s_qp_t", "s_qp_h", "s_kv_b", "s_kv_t",
           "s_o_t", "s_o_h"}
report = []
for arch, fmt, direct, heads, *extra in json.loads(sys.argv[1]):
    dcp, sink, rope = extra + [0, 0, 64][len(extra):]
    fp8, nvfp4 = fmt == "fp8_ds_mla", fmt == "nvfp4_ds_mla"
    bh = k.block_h(heads)
    sig = {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "kv_ptr": "*u8" if fp8 or nvfp4 else "*bf16",
           "idx_ptr": "*i32", "len_ptr": "*i32", "out_ptr": "*bf16" if direct else "*u8",
           "lse_ptr": "*fp32" if direct else "*u8", "l_ptr": "*bf16" if direct else "*u8",
           "err_ptr": "*i32", "sink_ptr": "*fp32", "req_ptr": "*i32", "bt_ptr": "*i32",
           "s_bt": "i32",
           "bt_width": "i32", "dcp_period": "i32", "dcp_start": "i32", "dcp_interleave": "i32",
           **{n: "i32" for n in INTS},
           "qk_scale": "fp32", **{n: "i32" for n in STRIDES}}
    const = dict(FP8=fp8, NVFP4=nvfp4, HAS_LENGTHS=True, DIRECT=direct, WRITE_LSE=True,
                 HAS_ERR=True,
                 LOGICAL=True, DCP=bool(dcp), SINK=bool(sink), ROPE=rope,
                 BLOCK_H=bh, BLOCK_K=k.CHUNK_K[k.FORMAT[fmt].reader], INTERPRET=False)
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n in ALIGNED}
    sig.update({c: "constexpr" for c in const})
    stages = k.num_stages(arch // 10, fp8, bh)
    ck = triton.compile(ASTSource(k._sparse_mla_split_kernel, sig, const, attrs),
                        target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=k.NUM_WARPS, num_stages=stages))
    usage = cubin_usage(ck)
    report.append({"arch": arch, "fmt": fmt, "direct": direct, "block_h": bh,
                   "dcp": const["DCP"], "sink": const["SINK"], "rope": rope, "stages": stages,
                   "shared": ck.metadata.shared, "usage": usage})
print(json.dumps(report))
"""


def test_kernel_compiles_for_gpu_targets():
    """Lower the split kernel to cubin for sm80/89/90/120 at both head tiles the launcher
    uses (H=16 -> 16 heads per program, H=128 -> 32) with Triton's bundled ptxas (no GPU
    needed): it compiles, fits the 99 KiB shared-memory limit (SM12x, SM89) and does not
    spill; also its DCP variant (the logical top-k filtered to this rank's shard) and its
    SINK variant (the attention sink folded into the direct epilogue; a split's partials
    are the no-sink code); and its ROPE=0 variant (no RoPE piece)."""

    pytest.importorskip("triton.backends.nvidia")
    cases = [[90, "fp8_ds_mla", False, 16], [120, "fp8_ds_mla", True, 16]]
    cases += [[120, "bf16", False, 16], [80, "bf16", True, 16]]
    cases += [[90, "fp8_ds_mla", False, 128], [120, "fp8_ds_mla", True, 64]]
    cases += [[80, "fp8_ds_mla", False, 128], [89, "fp8_ds_mla", True, 128]]
    cases += [[90, "bf16", False, 128], [120, "bf16", False, 64], [89, "bf16", True, 64]]
    # nvfp4_ds_mla: the loader dequantizes in registers, on every arch from SM80
    cases += [[80, "nvfp4_ds_mla", True, 16], [89, "nvfp4_ds_mla", False, 128]]
    cases += [[90, "nvfp4_ds_mla", True, 128], [120, "nvfp4_ds_mla", False, 64]]
    dcp = [[90, "fp8_ds_mla", False, 16, 1], [120, "fp8_ds_mla", True, 16, 1]]
    dcp += [[90, "fp8_ds_mla", False, 128, 1], [120, "fp8_ds_mla", True, 64, 1]]
    dcp += [[80, "bf16", True, 16, 1], [89, "fp8_ds_mla", True, 128, 1]]
    dcp += [[90, "nvfp4_ds_mla", True, 128, 1], [120, "nvfp4_ds_mla", False, 16, 1]]
    sink = [[120, "fp8_ds_mla", True, 16, 0, 1], [90, "fp8_ds_mla", True, 128, 0, 1]]
    sink += [[80, "bf16", True, 64, 0, 1], [89, "fp8_ds_mla", True, 64, 1, 1]]
    # ROPE=0 (latent-512 MLA without RoPE): the q_pe . k_pe piece not traced
    rope0 = [[120, "fp8_ds_mla", True, 16, 0, 0, 0], [90, "fp8_ds_mla", False, 128, 1, 0, 0]]
    rope0 += [[80, "bf16", True, 64, 0, 0, 0], [89, "bf16", False, 128, 0, 1, 0]]
    report = compile_report(AOT_SCRIPT, cases + dcp + sink + rope0)
    head, n = report[: -len(rope0)], len(rope0)
    assert [r["dcp"] for r in head[: -len(sink)]] == [False] * len(cases) + [True] * len(dcp)
    assert [r["sink"] for r in head] == [False] * (len(cases) + len(dcp)) + [True] * len(sink)
    assert [r["rope"] for r in report] == [64] * len(head) + [0] * n
    assert {r["block_h"] for r in report} == {16, 32}
    assert_fits(report)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_zero_tokens_and_negative_lengths(impl):
    cache = make_cache("bf16")
    empty = torch.zeros(0, 4, dtype=torch.int32)
    out, lse = sparse_mla_forward(
        make_q(0, 2), cache, empty, SCALE, kv_format="bf16", return_lse=True, impl=impl
    )
    assert out.shape == (0, 2, 512) and lse.shape == (0, 2)
    idx = make_indices(2, 8, 80, empty=0.0)
    lengths = torch.tensor([-3, 8], dtype=torch.int32)
    out, lse, ref, ref_lse, bound = run_both(make_q(2, 2), cache, idx, "bf16", lengths)
    assert_matches(out, lse, ref, ref_lse, bound)
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("h", [3, 40])
def test_logical_indices_are_mapped_in_the_kernel_like_vllms_conversion(fmt, h):
    """LaunchSite with req_id + block_table: the kernel maps logical top-k positions itself
    and must equal the physical launch on ``logical_to_physical`` (vLLM's map): -1, other
    negatives and positions past a request's table are empty; a table entry pointing
    past the pool is counted by ``invalid`` and read as empty (INDEX_RULE)."""
    from vllm_mla.ops.sparse_mla import logical_to_physical

    cache = make_cache(fmt)  # 5 blocks of 16
    bs, t, k = cache.shape[1], 4, 70
    block_table = torch.tensor([[3, 1, 4, 0], [2, 0, 0, 0], [4, 3, 2, 9]], dtype=torch.int32)
    req_id = torch.tensor([0, 2, 1, 0, 7], dtype=torch.int32)  # longer than T, as vLLM's
    gen = torch.Generator().manual_seed(h)
    logical = torch.randint(0, 4 * bs, (t, k), generator=gen, dtype=torch.int32)
    logical[:, :3] = torch.tensor([-1, -7, 4 * bs + 5], dtype=torch.int32)
    logical[1, 3] = 3 * bs + 2  # request 2, block 3 -> page 9: past the 5-page pool
    q = make_q(t, h, seed=h)
    q_nope, q_pe = q[..., :512], q[..., 512:]
    physical = logical_to_physical(req_id[:t], block_table, logical, bs)
    site = kernels.LaunchSite(cache, h, k, fmt, SCALE, q.dtype)
    outs, counts = [], []
    for kwargs in ({"req_id": req_id, "block_table": block_table}, {}):
        out = torch.empty(t, h, 512, dtype=q.dtype)
        invalid = torch.zeros(1, dtype=torch.int32)
        indices = logical if kwargs else physical
        site.launch(q_nope, q_pe, cache, indices, out, None, invalid=invalid, **kwargs)
        outs.append(out)
        counts.append(int(invalid))
    assert torch.equal(outs[0], outs[1])
    past_pool = int((physical >= cache.shape[0] * bs).sum())  # request 2's page-9 block
    assert past_pool > 0 and counts[0] == counts[1] == past_pool
    emptied = physical.clone()
    emptied[emptied >= cache.shape[0] * bs] = -1
    ref, _ = sparse_mla_reference(q, cache, emptied, SCALE, kv_format=fmt)
    assert_matches(outs[0], None, ref, None, bound_of(q, cache, emptied, fmt))
