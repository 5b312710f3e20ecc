"""Sparse MLA with an attention sink (HY-V4's learnable per-head logit).

Semantics (vLLM's HY-V4 FlashMLA path and transformers' eager HY-V4): per head a natural-log
logit ``s_h``, not scaled by ``softmax_scale``, joins the softmax denominator only:
``out = sum_j e^{x_j} v_j / (sum_j e^{x_j} + e^{s_h})``. Our lse includes it,
``log(sum_j e^{x_j} + e^{s_h})`` (FlashMLA's does not), which keeps vLLM's DCP merge of
per-rank LSEs exact when one rank adds the sink. A row with no valid index: out 0, lse
``s_h``; a -inf sink (vLLM pads heads with it) is no sink.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
from error_bounds import U, sparse_mla_bound
from test_sparse_mla import SCALE, assert_matches, make_cache, make_indices, make_q

from vllm_mla.ops.dcp import DCPShard, lse_merge
from vllm_mla.ops.sparse_mla import (
    KV_FORMATS,
    LATENT,
    PreparationSession,
    SparseMLACaps,
    SparseMLAError,
    SparseMLANotPrepared,
    SparseMLATypeError,
    b12x_runner,
    logical_to_physical,
    sparse_mla_forward,
    sparse_mla_reference,
)

pytest.importorskip("triton")
from vllm_mla.ops.sparse_mla import triton_kernels as kernels


def programs(monkeypatch, target: int) -> None:
    """Aim the split plan at ``target`` programs (1: every call direct). The cached launch
    sites keep the plans they computed, so they are dropped too."""
    monkeypatch.setattr(kernels, "TARGET_PROGRAMS", target)
    monkeypatch.setattr(kernels, "_sites", {})


def make_sink(h: int, seed: int = 0) -> torch.Tensor:
    """fp32 [h] sink logits around the row lses (so they matter), head 0 at -inf (no sink,
    vLLM's padding) when h > 2."""
    gen = torch.Generator().manual_seed(seed + 5)
    sink = torch.randn(h, generator=gen) * 2 + 4
    if h > 2:
        sink[0] = float("-inf")
    return sink


def run_both(q, cache, idx, fmt, sink, lengths=None):
    """(out, lse, ref, ref_lse, bound) of the Triton kernel and the reference with ``sink``."""
    out, lse = sparse_mla_forward(
        q,
        cache,
        idx,
        SCALE,
        kv_format=fmt,
        lengths=lengths,
        return_lse=True,
        impl="triton",
        sink=sink,
    )
    ref, ref_lse = sparse_mla_reference(
        q, cache, idx, SCALE, kv_format=fmt, lengths=lengths, sink=sink
    )
    return out, lse, ref, ref_lse, sparse_mla_bound(q, cache, idx, SCALE, fmt, lengths, sink=sink)


# -- the reference against the definition ---------------------------------------------------
def test_reference_against_an_fp64_softmax_with_sink():
    """The oracle on hand-built rows, against ``e^{x_j} / (sum_j e^{x_j} + e^{s_h})`` in
    float64: duplicates count twice, -1 and rows past lengths are ignored; a row with no
    valid index gives out 0 and lse s_h exactly; a -inf sink is no sink, a +inf one
    zeroes the output (lse +inf)."""
    cache = make_cache("bf16", num_blocks=2, block_size=4)
    q = make_q(2, 4, dtype=torch.float32)
    idx = torch.tensor([[3, -1, 5, 3, 7, 0], [2, 4, -1, -1, -1, -1]], dtype=torch.int32)
    lengths = torch.tensor([5, 0], dtype=torch.int32)  # token 1: no valid index
    sink = torch.tensor([0.75, -2.5, float("-inf"), float("inf")])
    out, lse = sparse_mla_reference(
        q, cache, idx, 0.1, kv_format="bf16", lengths=lengths, sink=sink
    )
    rows = cache.reshape(-1, 576)[[3, 5, 3, 7]].double()
    x = q[0].double() @ rows.T * 0.1  # [H, 4]
    denom = torch.exp(x).sum(-1) + torch.exp(sink.double())
    want = (torch.exp(x) / denom[:, None]) @ rows[:, :LATENT]
    want_lse = torch.log(denom)
    out_tol, lse_tol = sparse_mla_bound(
        q, cache, idx, 0.1, "bf16", lengths, sides=1, sink=sink
    )  # fp32 against the exact (float64) result
    finite = torch.isfinite(want_lse)
    assert finite.tolist() == [True, True, True, False]
    assert ((lse[0, finite].double() - want_lse[finite]).abs() <= lse_tol[0, finite]).all()
    assert ((out[0].double() - want).abs() <= out_tol[0]).all()
    assert lse[0, 3] == float("inf") and (out[0, 3] == 0).all()
    plain, plain_lse = sparse_mla_reference(q, cache, idx, 0.1, kv_format="bf16", lengths=lengths)
    assert torch.equal(out[0, 2], plain[0, 2]) and torch.equal(lse[0, 2], plain_lse[0, 2])
    assert (out[1] == 0).all()
    assert torch.equal(lse[1], sink)  # empty row: the sink alone (-inf and +inf included)


# -- Triton (interpreted) against the reference ---------------------------------------------
@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("ragged", [False, True])
def test_triton_matches_the_reference(fmt, direct, ragged, monkeypatch):
    """Split (the sink added once, in the combine kernel) and direct (in the epilogue),
    with and without lengths; token 1 has no valid index (lse = s_h, out 0); H=20 is one
    masked 32-head tile, and head 0's sink is -inf."""
    programs(monkeypatch, 1 if direct else kernels.TARGET_PROGRAMS)
    t, h, k = 5, 20, 70
    cache = make_cache(fmt)
    idx = make_indices(t, k, cache.shape[0] * cache.shape[1], seed=h)
    idx[1] = -1
    lengths = torch.tensor([70, 33, 0, 1, 500], dtype=torch.int32) if ragged else None
    plan = kernels.split_plan(t, h, k)
    assert plan.direct == direct and (direct or plan.num_splits == 3)
    sink = make_sink(h)
    out, lse, ref, ref_lse, bound = run_both(make_q(t, h, seed=h), cache, idx, fmt, sink, lengths)
    assert_matches(out, lse, ref, ref_lse, bound)
    empty = [1, 2] if ragged else [1]
    assert (out[empty] == 0).all()
    assert torch.isneginf(lse[empty, 0]).all()  # no sink, no index
    assert torch.isfinite(lse[empty, 1:]).all()  # the sink alone
    _, plain_lse = sparse_mla_reference(
        make_q(t, h, seed=h), cache, idx, SCALE, kv_format=fmt, lengths=lengths
    )
    live = torch.isfinite(plain_lse)
    assert (lse[live] - plain_lse[live]).abs().max() > 0.1  # the sink matters here


@pytest.mark.parametrize("direct", [False, True])
def test_a_minus_inf_sink_is_bit_identical_to_no_sink(direct, monkeypatch):
    """vLLM pads heads (and initialises HY-V4's sink) with -inf: no sink, to the bit."""
    programs(monkeypatch, 1 if direct else kernels.TARGET_PROGRAMS)
    for fmt in KV_FORMATS:
        cache = make_cache(fmt)
        idx = make_indices(3, 70, cache.shape[0] * cache.shape[1])
        idx[0] = -1
        q = make_q(3, 5)
        minus_inf = torch.full((5,), float("-inf"))
        for impl in ("triton", "reference"):
            a = sparse_mla_forward(q, cache, idx, SCALE, kv_format=fmt, return_lse=True, impl=impl)
            b = sparse_mla_forward(
                q, cache, idx, SCALE, kv_format=fmt, return_lse=True, impl=impl, sink=minus_inf
            )
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (fmt, impl)


def test_empty_rows_with_a_sink_give_zero_and_the_sink(monkeypatch):
    """Both paths: a row with no valid index and a finite sink gives out 0 (exactly) and
    lse s_h (two fp32 roundings: s log2 e, then ln 2)."""
    sink = torch.tensor([3.0, -7.25, 0.0])
    cache = make_cache("fp8_ds_mla")
    idx = torch.full((2, 40), -1, dtype=torch.int32)
    for target in (256, 1):
        programs(monkeypatch, target)
        assert kernels.split_plan(2, 3, 40).direct == (target == 1)
        out, lse = sparse_mla_forward(
            make_q(2, 3),
            cache,
            idx,
            SCALE,
            kv_format="fp8_ds_mla",
            return_lse=True,
            impl="triton",
            sink=sink,
        )
        assert (out == 0).all()
        # s * log2 e, then * ln 2, each constant rounded to fp32: 4 roundings, 2x slack
        assert ((lse - sink).abs() <= 8 * U * sink.abs()).all()


@pytest.mark.parametrize("direct", [False, True])
def test_infinite_sinks(direct, monkeypatch):
    """-inf: no sink; +inf: the sink takes all the weight (out 0, lse +inf, FlashMLA's
    documented +inf behaviour), never a NaN from ``inf - inf``; rows with and without a
    valid index."""
    programs(monkeypatch, 1 if direct else kernels.TARGET_PROGRAMS)
    cache = make_cache("bf16")
    idx = make_indices(3, 70, cache.shape[0] * cache.shape[1])
    idx[2] = -1
    sink = torch.tensor([float("-inf"), float("inf"), 2.0])
    out, lse, ref, ref_lse, bound = run_both(make_q(3, 3), cache, idx, "bf16", sink)
    assert kernels.split_plan(3, 3, 70).direct == direct
    assert_matches(out, lse, ref, ref_lse, bound)
    assert (out[:, 1] == 0).all() and (lse[:, 1] == float("inf")).all()
    assert torch.isneginf(lse[2, 0]) and (out[2] == 0).all()


def test_the_sink_takes_any_heads_and_strided_q(monkeypatch):
    """H=1 (one masked 16-head tile) and H=40 (two 32-head tiles, the second masked):
    each head gets its own sink, also with a strided split q."""
    for h in (1, 40):
        cache = make_cache("bf16")
        idx = make_indices(2, 50, cache.shape[0] * cache.shape[1], seed=h)
        full = make_q(2, h, seed=h)
        q = (full[..., :LATENT], full[..., LATENT:])
        sink = make_sink(h, seed=h)
        out, lse, ref, ref_lse, bound = run_both(q, cache, idx, "bf16", sink)
        assert_matches(out, lse, ref, ref_lse, bound)


# -- DCP: the sink on one rank keeps the LSE merge exact ------------------------------------
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_sink_on_one_rank_merges_to_the_sink_over_all_ranks(impl):
    """Two ranks, each attending to the positions it holds; rank 0 adds the sink, rank 1
    not. vLLM's LSE merge of the two (``ops.dcp.lse_merge``) equals one rank over all
    positions with the sink, because our lse counts the sink (FlashMLA's would not)."""
    fmt, t, h, k = "bf16", 3, 6, 40
    cache = make_cache(fmt)
    rows = cache.shape[0] * cache.shape[1]
    idx = make_indices(t, k, rows, empty=0.1)
    q = make_q(t, h, dtype=torch.float32)  # fp32 out: no output rounding in the merge
    sink = make_sink(h)
    shard = DCPShard(2, 0, 1)
    owner = shard.owner(idx.long())
    outs, lses, mine = [], [], []
    for rank in range(2):
        mine.append(torch.where((idx >= 0) & (owner == rank), idx, -1))
        out, lse = sparse_mla_forward(
            q,
            cache,
            mine[rank],
            SCALE,
            kv_format=fmt,
            return_lse=True,
            impl=impl,
            sink=sink if rank == 0 else None,
        )
        outs.append(out.float())
        lses.append(lse)
    merged, merged_lse = lse_merge(torch.stack(outs), torch.stack(lses))
    ref, ref_lse = sparse_mla_reference(q, cache, idx, SCALE, kv_format=fmt, sink=sink)
    out_tol, lse_tol = sparse_mla_bound(q, cache, idx, SCALE, fmt, sink=sink)
    # the merge's own roundings (tests/test_sparse_dcp.py MERGE_ROUNDINGS), on max |v|
    extra = 8 * U * (1 + ref_lse.double().abs())
    magnitude = cache.reshape(-1, 576)[:, :LATENT].float().abs().max().double()
    out_tol = out_tol + extra[..., None] * magnitude
    assert ((merged.double() - ref.double()).abs() <= out_tol).all()
    assert ((merged_lse.double() - ref_lse.double()).abs() <= lse_tol + extra).all()
    # FlashMLA's convention (rank 0's lse without the sink) would not merge to it
    _, flashmla_lse = sparse_mla_reference(q, cache, mine[0], SCALE, kv_format=fmt)
    wrong, _ = lse_merge(torch.stack(outs), torch.stack([flashmla_lse, lses[1]]))
    assert ((wrong.double() - ref.double()).abs() > out_tol).any()


def test_the_dcp_variant_with_a_sink_matches_the_reference():
    """The kernel's DCP variant (logical top-k of the group, filtered to this rank) with a
    sink: equal to the reference on the rank's physical rows with the sink."""
    fmt, h, k, bs = "fp8_ds_mla", 4, 50, 16
    cache = make_cache(fmt)  # 5 pages of 16
    table = torch.tensor([[3, 1, 4, 0], [2, 0, 4, 1]], dtype=torch.int32)
    req_id = torch.tensor([0, 1, 1], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    logical = torch.randint(-1, 8 * bs, (3, k), generator=gen, dtype=torch.int32)
    q = make_q(3, h)
    sink = make_sink(h)
    shard = DCPShard(2, 1, 4)
    site = kernels.LaunchSite(cache, h, k, fmt, SCALE, q.dtype)
    out = torch.empty(3, h, LATENT, dtype=q.dtype)
    lse = torch.empty(3, h)
    site.launch(
        q[..., :LATENT],
        q[..., LATENT:],
        cache,
        logical,
        out,
        None,
        lse=lse,
        req_id=req_id,
        block_table=table,
        dcp=shard.args,
        sink=sink,
    )
    phys = logical_to_physical(req_id, table, logical, bs, shard=shard)
    ref, ref_lse = sparse_mla_reference(q, cache, phys, SCALE, kv_format=fmt, sink=sink)
    bound = sparse_mla_bound(q, cache, phys, SCALE, fmt, sink=sink)
    assert_matches(out, lse, ref, ref_lse, bound)


# -- the contract ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sink", "exc", "match"),
    [
        (torch.zeros(2, dtype=torch.bfloat16), SparseMLATypeError, r"sink: expected dtype"),
        (torch.zeros(3), SparseMLAError, r"sink: expected shape \[2\]"),
        (torch.zeros(2, 1), SparseMLAError, r"sink: expected shape \[2\]"),
        (torch.zeros(4)[::2], SparseMLAError, r"sink: last dim must be contiguous"),
        ([0.0, 0.0], SparseMLATypeError, r"sink: expected a Tensor"),
    ],
)
def test_a_bad_sink_is_named(sink, exc, match):
    cache = make_cache("bf16", num_blocks=2, block_size=8)
    args = (make_q(2, 2), cache, make_indices(2, 8, 16), SCALE)
    for impl in ("reference", "triton"):
        with pytest.raises(exc, match=match):
            sparse_mla_forward(*args, kv_format="bf16", impl=impl, sink=sink)
    with pytest.raises(exc, match=match):
        sparse_mla_reference(*args, kv_format="bf16", sink=sink)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_custom_op_with_a_sink_passes_opcheck(impl):
    cache = make_cache("fp8_ds_mla", num_blocks=2, block_size=8)
    t, h = 2, 3
    q = make_q(t, h)
    torch.library.opcheck(
        torch.ops.vllm_mla.sparse_mla_forward,
        (
            q[..., :512],
            q[..., 512:],
            cache,
            make_indices(t, 16, 16),
            torch.tensor([16, 3], dtype=torch.int32),
            torch.empty(t, h, 512, dtype=torch.bfloat16),
            torch.empty(t, h),
            None,
            None,
            SCALE,
            "fp8_ds_mla",
            impl,
            make_sink(h),
        ),
        test_utils=(
            "test_schema",
            "test_autograd_registration",
            "test_faketensor",
            "test_aot_dispatch_dynamic",
        ),
    )


def test_the_sink_is_a_variant_of_its_own_and_prewarm_prepares_it(monkeypatch):
    monkeypatch.setattr(kernels, "_compiled", set())
    cache = make_cache("fp8_ds_mla")
    common = {"num_heads": 2, "topk": 40, "kv_format": "fp8_ds_mla", "impl": "triton"}
    from vllm_mla.ops import sparse_mla as sm

    assert sm.prewarm(cache, token_counts=[2], **common) == 1
    monkeypatch.setattr(kernels, "capturing", lambda device: True)
    idx = make_indices(2, 40, cache.shape[0] * cache.shape[1])
    with pytest.raises(SparseMLANotPrepared, match="sink=True"):
        sparse_mla_forward(
            make_q(2, 2),
            cache,
            idx,
            SCALE,
            kv_format="fp8_ds_mla",
            impl="triton",
            sink=make_sink(2),
        )
    monkeypatch.setattr(kernels, "capturing", lambda device: False)
    assert sm.prewarm(cache, token_counts=[2], with_sink=True, **common) == 1
    monkeypatch.setattr(kernels, "capturing", lambda device: True)
    sparse_mla_forward(
        make_q(2, 2), cache, idx, SCALE, kv_format="fp8_ds_mla", impl="triton", sink=make_sink(2)
    )


# -- preparation: a plan declares the sink --------------------------------------------------
def test_a_bound_call_with_a_declared_sink(monkeypatch):
    """``SparseMLACaps(sink=True)``: the probes launch the sink variant, so after freeze a
    bound call with the sink compiles nothing; a call without it (or a plan without the
    sink given one) is refused, naming the sink."""
    monkeypatch.setattr(kernels, "_compiled", set())
    h, k, fmt = 3, 40, "bf16"
    caps = SparseMLACaps(
        max_tokens=4, num_heads=h, topk=k, kv_format=fmt, block_size=64, return_lse=True, sink=True
    )
    session = PreparationSession("cpu")
    plan = session.plan(caps, impl="triton")
    session.prepare(plan)
    session.freeze()
    cache = make_cache(fmt, num_blocks=2, block_size=64)
    call = session.bound_call(plan, softmax_scale=SCALE)
    q = make_q(4, h)
    q_nope, q_pe = q[..., :LATENT], q[..., LATENT:]
    idx = make_indices(4, k, 128)
    sink = make_sink(h)
    lse = torch.empty(4, h)
    out = call.run(q_nope, q_pe, cache, idx, lse=lse, sink=sink)  # compiles nothing
    ref, ref_lse = sparse_mla_reference(q, cache, idx, SCALE, kv_format=fmt, sink=sink)
    assert_matches(out, lse, ref, ref_lse, sparse_mla_bound(q, cache, idx, SCALE, fmt, sink=sink))
    with pytest.raises(ValueError, match="sink: the plan declares sink=True, got None"):
        call.run(q_nope, q_pe, cache, idx, lse=lse)
    with pytest.raises(ValueError, match=r"sink: expected fp32 \[3\]"):
        call.run(q_nope, q_pe, cache, idx, lse=lse, sink=sink.double())
    plain_plan = session.plan(dataclasses.replace(caps, sink=False), impl="triton")
    plain = session.bound_call(plain_plan, softmax_scale=SCALE)
    with pytest.raises(ValueError, match="sink: the plan declares sink=False, got a tensor"):
        plain.run(q_nope, q_pe, cache, idx, sink=sink)
    binding = None
    with pytest.raises(ValueError, match="sink=True, got None"):
        binding = session.bind(plan, scratch=None, q=(q_nope, q_pe), kv_cache=cache, indices=idx)
    assert binding is None


def test_the_sink_is_in_the_launch_key():
    from vllm_mla.ops.sparse_mla.preparation import launch_key

    caps = SparseMLACaps(max_tokens=4, num_heads=2, topk=8)
    with_sink = SparseMLACaps(max_tokens=4, num_heads=2, topk=8, sink=True)
    device = torch.device("cpu")
    assert launch_key(caps, "triton", 2, device) != launch_key(with_sink, "triton", 2, device)


# -- b12x declines a sink -------------------------------------------------------------------
def test_b12x_declines_a_call_with_a_sink_and_says_so_once(monkeypatch, caplog):
    """b12x 1.5.1 has no sink input: the runner returns False (Triton serves), writing
    nothing, and logs the reason once per process."""
    monkeypatch.setattr(b12x_runner, "_declined", set())
    monkeypatch.setattr(b12x_runner, "b12x_module", lambda: pytest.fail("b12x reached"))
    cache = make_cache("fp8_ds_mla", num_blocks=2, block_size=64)
    q = make_q(2, 2)
    out = torch.full((2, 2, LATENT), 7.0, dtype=torch.bfloat16)
    assert b12x_runner.unserved_reason(q, "fp8_ds_mla", SCALE, None, make_sink(2)) == (
        "an attention sink (b12x's sparse-MLA Caps and bind take none)"
    )
    with caplog.at_level(logging.INFO, logger="vllm_mla"):
        for _ in range(3):
            served = b12x_runner.run_b12x(
                q[..., :LATENT],
                q[..., LATENT:],
                cache,
                make_indices(2, 8, 128),
                None,
                out,
                None,
                None,
                softmax_scale=SCALE,
                kv_format="fp8_ds_mla",
                sink=make_sink(2),
            )
            assert served is False
    assert (out == 7.0).all()
    said = [r.getMessage() for r in caplog.records if "attention sink" in r.getMessage()]
    assert len(said) == 1 and "Triton kernel serves it" in said[0]


def test_the_dispatcher_hands_the_sink_to_the_b12x_runner_then_triton(monkeypatch):
    """``dispatch.run`` passes the sink to the runner; a decline runs Triton with it."""
    from vllm_mla.ops.sparse_mla import dispatch

    seen = {}
    monkeypatch.setattr(dispatch, "_b12x_runner", lambda *a, **kw: seen.update(kw) and False)
    cache = make_cache("bf16")
    idx = make_indices(2, 40, cache.shape[0] * cache.shape[1])
    q = make_q(2, 3)
    sink = make_sink(3)
    out = torch.empty(2, 3, LATENT, dtype=torch.bfloat16)
    lse = torch.empty(2, 3)
    dispatch.run(
        "b12x",
        q[..., :LATENT],
        q[..., LATENT:],
        cache,
        idx,
        out,
        softmax_scale=SCALE,
        kv_format="bf16",
        lse=lse,
        sink=sink,
    )
    assert seen["sink"] is sink
    ref, ref_lse = sparse_mla_reference(q, cache, idx, SCALE, kv_format="bf16", sink=sink)
    assert_matches(
        out, lse, ref, ref_lse, sparse_mla_bound(q, cache, idx, SCALE, "bf16", sink=sink)
    )


def test_the_sink_is_not_scaled_by_softmax_scale():
    """``softmax_scale`` multiplies q.k only (HY-V4 compares the raw sink with the scaled
    logits): doubling the scale and halving q changes nothing, the sink included."""
    cache = make_cache("bf16")
    idx = make_indices(2, 30, cache.shape[0] * cache.shape[1])
    q = make_q(2, 3, dtype=torch.float32)
    sink = make_sink(3)
    a = sparse_mla_reference(q, cache, idx, SCALE, kv_format="bf16", sink=sink)
    b = sparse_mla_reference(q / 2, cache, idx, 2 * SCALE, kv_format="bf16", sink=sink)
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[1], b[1], atol=1e-6)
    c = sparse_mla_reference(q, cache, idx, SCALE, kv_format="bf16", sink=sink * 2)
    assert not torch.allclose(a[1], c[1])
    assert math.isfinite(float(a[1][0, 1]))
