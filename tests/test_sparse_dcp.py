"""Decode context parallelism (DCP) of sparse MLA and of the DSA indexer, against DCP 1.

One KV set (two requests) laid out twice: whole in one cache (DCP 1), and sharded over
N ranks the way vLLM's slot mapping places it (``ops.dcp.DCPShard``: runs of
``interleave`` positions round robin, each rank's own pages and block table). Every rank
attends to the selected request positions it holds and returns its LSE; the ranks are
merged with vLLM's LSE combine (``_lse_weighted_combine`` of
``vllm/v1/attention/ops/dcp.py``, reproduced in ``vllm_mla.ops.dcp.lse_merge``): the result
must be DCP 1's. The indexer: each rank scores its shard, the local top-K candidates are
merged: the selection must be DCP 1's, exactly (ties included).
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from error_bounds import U, sparse_mla_bound

from vllm_mla.ops import sparse_indexer
from vllm_mla.ops.dcp import NO_DCP, DCPShard, lse_merge
from vllm_mla.ops.sparse_indexer import dcp as dcp_topk
from vllm_mla.ops.sparse_indexer.dispatch import kernels_for
from vllm_mla.ops.sparse_mla import (
    KV_FORMATS,
    LATENT,
    PreparationSession,
    SparseMLACaps,
    logical_to_physical,
    pack_rows,
    sparse_mla_reference,
    unpack_rows,
)

SCALE = 1 / math.sqrt(192 + 64)
BS = 16  # page rows (the kernel's 64-row pages are not needed by the op)
LENGTHS = (70, 37)  # two requests, global lengths
TOKEN_REQUEST = (0, 0, 1)  # the request of each of the 3 scored tokens
SHARDS = [(2, 1), (2, 4), (3, 2), (2, 16)]  # (N, interleave)
# The merge, per weight exp(lse_r - lse): the lse_r rounding (a log), the exp, the N-term
# sum and its log, the product with out_r: 8 roundings of 1 + |lse| (a slack of 2x).
MERGE_ROUNDINGS = 8


# -- the sharded KV set ---------------------------------------------------------------------
def records(n: int, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """``n`` packed rows on binary grids (every dot exact in fp32: error_bounds.exact_dots)."""
    kv_c = torch.randint(-7, 8, (n, 512), generator=gen) / 8
    kv_c[:, ::128] = 7 / 8  # power-of-two fp8 group scales
    kv_c *= torch.exp2(torch.randint(-2, 2, (n, 1), generator=gen).float())
    k_pe = torch.randint(-8, 9, (n, 64), generator=gen) / 8
    return pack_rows(kv_c, k_pe, fmt)


def place(rows_of: list[torch.Tensor], fmt: str, gen: torch.Generator):
    """A cache holding each request's rows at local positions 0..n-1 through a shuffled
    block table, plus 2 spare pages: (cache, block table int32 [R, W])."""
    pages = [-(-r.shape[0] // BS) for r in rows_of]
    total = sum(pages) + 2
    order = torch.randperm(total, generator=gen)
    width = max(max(pages), 1)
    table = torch.zeros(len(rows_of), width, dtype=torch.int32)
    cache = torch.zeros(total, BS, rows_of[0].shape[1], dtype=rows_of[0].dtype)
    used = 0
    for req, rows in enumerate(rows_of):
        for p in range(pages[req]):
            page = int(order[used])
            used += 1
            table[req, p] = page
            chunk = rows[p * BS : (p + 1) * BS]
            cache[page, : chunk.shape[0]] = chunk
    return cache, table


def kv_set(fmt: str, n: int, interleave: int, seed: int = 0):
    """(global rows per request, DCP 1 (cache, table), per rank [(shard, cache, table)])."""
    gen = torch.Generator().manual_seed(seed)
    rows = [records(length, fmt, gen) for length in LENGTHS]
    whole = place(rows, fmt, gen)
    ranks = []
    for r in range(n):
        shard = DCPShard(n, r, interleave)
        local = []
        for req_rows in rows:
            held = shard.to_local(torch.arange(req_rows.shape[0])) >= 0
            local.append(req_rows[held])  # local position order = request position order
        ranks.append((shard, *place(local, fmt, gen)))
    return rows, whole, ranks


def selection(k: int = 24, seed: int = 0) -> torch.Tensor:
    """int32 [3, k] request positions: distinct, in the token's request, some -1."""
    gen = torch.Generator().manual_seed(seed + 7)
    out = torch.full((len(TOKEN_REQUEST), k), -1, dtype=torch.int32)
    for t, req in enumerate(TOKEN_REQUEST):
        picked = torch.randperm(LENGTHS[req], generator=gen)[:k]
        out[t, : picked.numel()] = picked.int()
    out[torch.rand(out.shape, generator=gen) < 0.15] = -1
    return out


def query(h: int = 6, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 3)
    return torch.randint(-8, 9, (len(TOKEN_REQUEST), h, 576), generator=gen) / 4  # fp32


REQ_ID = torch.tensor(TOKEN_REQUEST, dtype=torch.int32)


def merge_tolerance(q, cache, physical, fmt, ref_lse):
    """(out_tol, lse_tol): DCP 1 against the merge of the ranks, both fp32.

    Error model: the merge is the same softmax summed in another order (the ranks'
    partial sums, then the LSE-weighted sum), so ``sparse_mla_bound`` (two fp32
    evaluations in any orders, dots exact here) holds for it, plus the merge's own
    roundings: each weight ``exp(lse_r - lse)`` carries ``MERGE_ROUNDINGS`` of
    ``1 + |lse|`` more, on ``M = sum_j w_j |v_j|`` for the output."""
    out_tol, lse_tol = sparse_mla_bound(q, cache, physical, SCALE, fmt)
    extra = MERGE_ROUNDINGS * U * (1 + ref_lse.double().abs().nan_to_num(0.0, posinf=0.0))
    kv_c, _ = unpack_rows(cache, physical.clamp(min=0), fmt)
    magnitude = kv_c.abs().amax().double()  # M = sum_j w_j |v_j| <= max |v|
    return out_tol + extra[..., None] * magnitude, lse_tol + extra


def assert_close(out, lse, ref, ref_lse, tol):
    out_tol, lse_tol = tol
    assert not out.isnan().any()
    assert ((out.double() - ref.double()).abs() <= out_tol).all(), (
        (out.double() - ref.double()).abs() - out_tol
    ).max()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert ((lse[finite].double() - ref_lse[finite]).abs() <= lse_tol[finite]).all()


# -- the shard's positions ------------------------------------------------------------------
@pytest.mark.parametrize(("n", "interleave"), SHARDS)
def test_every_position_has_one_owner_and_one_local_place(n, interleave):
    positions = torch.arange(400)
    lengths = torch.arange(0, 401)
    owners = DCPShard(n, 0, interleave).owner(positions)
    total = torch.zeros_like(lengths)
    for r in range(n):
        shard = DCPShard(n, r, interleave)
        local = shard.to_local(positions)
        held = local >= 0
        assert torch.equal(held, owners == r)
        assert torch.equal(local[held], torch.arange(int(held.sum())))  # dense, in order
        assert torch.equal(shard.to_global(local[held]), positions[held])
        # vLLM's get_dcp_local_seq_lens: how many of the first L positions rank r holds
        brute = torch.stack([(owners[:length] == r).sum() for length in lengths.tolist()])
        assert torch.equal(shard.local_length(lengths), brute)
        total += brute
        assert shard.local_bound(400) >= int(held.sum())
    assert torch.equal(total, lengths)
    empty = torch.tensor([-1])
    assert torch.equal(DCPShard(n, n - 1, interleave).to_local(empty), empty)


def test_no_dcp_is_the_identity_and_bad_shards_are_named():
    x = torch.tensor([-1, 0, 5, 99])
    assert NO_DCP.to_local(x) is x and NO_DCP.to_global(x) is x and NO_DCP.trivial
    for bad in ((0, 0, 1), (2, 2, 1), (2, 0, 0)):
        with pytest.raises(ValueError, match="DCPShard"):
            DCPShard(*bad)


@pytest.mark.parametrize(("n", "interleave"), SHARDS)
def test_a_rank_maps_the_positions_it_holds_to_the_same_records(n, interleave):
    """``logical_to_physical(..., shard=)`` (the torch form of vLLM's
    ``triton_filter_and_convert_dcp_index``): a held position's physical row on its rank
    holds the record DCP 1's row holds; every other position is -1."""
    _, (cache1, table1), ranks = kv_set("bf16", n, interleave)
    logical = selection()
    whole = logical_to_physical(REQ_ID, table1, logical, BS)
    seen = torch.zeros_like(logical, dtype=torch.int32)
    for shard, cache, table in ranks:
        phys = logical_to_physical(REQ_ID, table, logical, BS, shard=shard)
        held = (logical >= 0) & (shard.owner(logical.long()) == shard.rank)
        assert torch.equal(phys >= 0, held)
        flat, flat1 = cache.reshape(-1, 576), cache1.reshape(-1, 576)
        assert torch.equal(flat[phys[held].long()], flat1[whole[held].long()])
        seen += held.int()
    assert torch.equal(seen, (logical >= 0).int())  # every selected position once


# -- attention: per rank, merged by LSE -----------------------------------------------------
def per_rank(fmt, n, interleave, impl="reference", seed=0):
    """DCP 1's (out, lse, tolerance) and every rank's (out, lse) by ``impl``."""
    _, (cache1, table1), ranks = kv_set(fmt, n, interleave, seed)
    q, logical = query(seed=seed), selection(seed=seed)
    whole = logical_to_physical(REQ_ID, table1, logical, BS)
    ref, ref_lse = sparse_mla_reference(q, cache1, whole, SCALE, kv_format=fmt)
    outs, lses = [], []
    for shard, cache, table in ranks:
        if impl == "reference":
            phys = logical_to_physical(REQ_ID, table, logical, BS, shard=shard)
            out, lse = sparse_mla_reference(q, cache, phys, SCALE, kv_format=fmt)
        else:  # the Triton kernel maps and filters the logical top-k itself
            out, lse = triton_logical(q, cache, logical, table, shard, fmt)
        outs.append(out)
        lses.append(lse)
    tol = merge_tolerance(q, cache1, whole, fmt, ref_lse)
    return (ref, ref_lse, tol), torch.stack(outs), torch.stack(lses), (q, logical, ranks)


def triton_logical(q, cache, logical, table, shard, fmt):
    from vllm_mla.ops.sparse_mla import triton_kernels

    t, h = q.shape[:2]
    out = torch.empty(t, h, LATENT)
    lse = torch.empty(t, h)
    site = triton_kernels.LaunchSite(cache, h, logical.shape[1], fmt, SCALE, q.dtype)
    site.launch(
        q[..., :LATENT],
        q[..., LATENT:],
        cache,
        logical,
        out,
        None,
        lse=lse,
        req_id=REQ_ID,
        block_table=table,
        dcp=shard.args,
    )
    return out, lse


@pytest.mark.parametrize(("n", "interleave"), SHARDS)
@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_the_reference_per_rank_merged_by_lse_equals_dcp1(fmt, n, interleave):
    (ref, ref_lse, tol), outs, lses, _ = per_rank(fmt, n, interleave)
    merged, merged_lse = lse_merge(outs, lses)
    assert_close(merged, merged_lse, ref, ref_lse, tol)
    assert lses.dtype == torch.float32 and lses.shape[1:] == ref_lse.shape  # [T, H], natural


@pytest.mark.parametrize(("n", "interleave"), [(2, 1), (3, 2), (2, 16)])
@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_the_triton_kernel_filters_the_logical_top_k_and_returns_the_lse(fmt, n, interleave):
    """The Triton kernel (interpreted) with the logical top-k, this rank's block table and
    its DCP shard: each rank within the bound of that rank's reference, and the merge
    within the DCP 1 tolerance."""
    pytest.importorskip("triton")
    (ref, ref_lse, tol), outs, lses, (q, logical, ranks) = per_rank(fmt, n, interleave, "triton")
    for (shard, cache, table), out, lse in zip(ranks, outs, lses, strict=True):
        phys = logical_to_physical(REQ_ID, table, logical, BS, shard=shard)
        want, want_lse = sparse_mla_reference(q, cache, phys, SCALE, kv_format=fmt)
        assert_close(out, lse, want, want_lse, sparse_mla_bound(q, cache, phys, SCALE, fmt))
    merged, merged_lse = lse_merge(outs, lses)
    assert_close(merged, merged_lse, ref, ref_lse, tol)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_rank_holding_none_of_a_rows_selection_is_the_merge_identity(impl):
    """Token 2 selects only positions rank 0 holds: rank 1 gives out 0 and lse -inf for
    it (what drops a rank from vLLM's merge), in both implementations."""
    if impl == "triton":
        pytest.importorskip("triton")
    _, _, ranks = kv_set("fp8_ds_mla", 2, 1)
    q, logical = query(), selection()
    logical[2] = -1
    logical[2, :5] = torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32)  # rank 0's only
    shard, cache, table = ranks[1]
    if impl == "reference":
        phys = logical_to_physical(REQ_ID, table, logical, BS, shard=shard)
        out, lse = sparse_mla_reference(q, cache, phys, SCALE, kv_format="fp8_ds_mla")
    else:
        out, lse = triton_logical(q, cache, logical, table, shard, "fp8_ds_mla")
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    assert torch.isfinite(lse[:2]).all()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_the_bound_call_serves_dcp_with_its_lse(impl):
    """The decode-step entry (``BoundCall.run``) with a DCP shard and an lse buffer, after
    ``freeze()``: the logical call (Triton: the DCP variant the probes compiled) and the
    physical one (reference, rows filtered by the caller) give the rank's reference out
    and lse; an lse or a shard the plan does not declare is named."""
    if impl == "triton":
        pytest.importorskip("triton")
    fmt, n = "fp8_ds_mla", 2
    _, _, ranks = kv_set(fmt, n, 1)
    q, logical = query(), selection()
    t, h, k = q.shape[0], q.shape[1], logical.shape[1]
    caps = SparseMLACaps(  # block_size: the probes' pages (the live cache's are BS rows)
        max_tokens=4,
        num_heads=h,
        topk=k,
        kv_format=fmt,
        q_dtype=torch.float32,
        return_lse=True,
        dcp=True,
    )
    session = PreparationSession("cpu")
    plan = session.plan(caps, impl=impl)
    session.prepare(plan)
    session.freeze()  # from here a variant the probes did not compile raises
    for shard, cache, table in ranks:
        call = session.bound_call(plan, softmax_scale=SCALE, dcp=shard)
        lse = torch.full((t, h), float("nan"))
        phys = logical_to_physical(REQ_ID, table, logical, BS, shard=shard)
        if call.maps_logical:
            out = call.run(q[..., :LATENT], q[..., LATENT:], cache, logical, REQ_ID, table, lse=lse)
        else:
            out = call.run(q[..., :LATENT], q[..., LATENT:], cache, phys, lse=lse)
        want, want_lse = sparse_mla_reference(q, cache, phys, SCALE, kv_format=fmt)
        assert_close(out, lse, want, want_lse, sparse_mla_bound(q, cache, phys, SCALE, fmt))
    session = PreparationSession("cpu")
    no_lse = session.plan(dataclasses.replace(caps, return_lse=False, dcp=False), impl=impl)
    session.prepare(no_lse)
    call = session.bound_call(no_lse, softmax_scale=SCALE)
    with pytest.raises(ValueError, match="return_lse"):
        call.run(q[..., :LATENT], q[..., LATENT:], ranks[0][1], phys, lse=torch.empty(t, h))
    with pytest.raises(ValueError, match=r"caps\.dcp=False"):  # its DCP variant: unprepared
        session.bound_call(no_lse, softmax_scale=SCALE, dcp=ranks[0][0])


# -- the indexer: local candidates, merged -------------------------------------------------
@pytest.mark.parametrize(("n", "interleave"), SHARDS)
def test_merged_candidates_are_the_dcp1_selection_ties_included(n, interleave):
    """``dcp_select`` (every rank's ``candidate_keys``, ``merge_candidates``) against
    ``reference.select_topk`` on the whole row: identical, on integer logits (many ties),
    -0.0 and +0.0, NaN, ragged lengths, top-k past a rank's length and past the row's."""
    gen = torch.Generator().manual_seed(n * 10 + interleave)
    for trial in range(20):
        length = int(torch.randint(1, 200, (1,), generator=gen))
        k = int(torch.randint(1, 48, (1,), generator=gen))
        scores = torch.randint(-4, 5, (6, length), generator=gen).float()
        scores[0, ::3] = -0.0
        scores[1, ::7] = float("nan")
        lengths = torch.randint(0, length + 1, (6,), generator=gen)
        want = sparse_indexer.select_topk(scores, lengths, k)
        positions = torch.arange(length)
        local_scores, local_lengths = [], []
        for r in range(n):
            shard = DCPShard(n, r, interleave)
            local_scores.append(scores[:, shard.to_local(positions) >= 0])
            local_lengths.append(shard.local_length(lengths))
        got = dcp_topk.dcp_select(local_scores, local_lengths, k, interleave)
        assert torch.equal(got, want), (trial, (got != want).nonzero()[:4].tolist())


class Gather:
    """vLLM's DCP group's ``all_gather(x, dim=0)`` for ranks run one after the other: the
    first pass records each rank's tensor, the second returns all of them."""

    def __init__(self, n: int):
        self.n, self.seen = n, []

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        assert dim == 0
        if len(self.seen) < self.n:
            self.seen.append(x.clone())
            return torch.cat([x] * self.n)  # pass 1: discarded
        return torch.cat(self.seen)


def indexer_step(n: int, interleave: int, seed: int = 0, topk: int = 16):
    """A decode token of each request and a 3-token prefill chunk of request 0 (its last 3
    positions), index keys of every position inserted by slot: DCP 1's layer and metadata,
    and every rank's (its shard of the keys, its own pages, vLLM's localized metadata:
    decode seq_lens and prefill ks/ke of this rank, ``local_cu_seq_lens``)."""
    from vllm_mla.vllm.sparse import cpu

    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(length, 128, generator=gen) for length in LENGTHS]
    q = (torch.randn(5, 4, 128, generator=gen) * 3).to(torch.float8_e4m3fn)
    weights = torch.rand(5, 4, generator=gen)

    def build(shard):
        local = [kk[shard.to_local(torch.arange(kk.shape[0])) >= 0] for kk in keys]
        pages = [-(-kk.shape[0] // 64) for kk in local]
        cache = torch.zeros(sum(pages) + 1, 64, sparse_indexer.RECORD_BYTES, dtype=torch.uint8)
        table = torch.zeros(2, max(pages), dtype=torch.int32)
        first = 1  # page 0 stays empty: a wrong table reads zeros
        for req, kk in enumerate(local):
            table[req, : pages[req]] = torch.arange(first, first + pages[req])
            first += pages[req]
            slots = sparse_indexer.request_rows(table[req], kk.shape[0], 64)
            sparse_indexer.insert_keys(cache, kk, slots)
        lengths = torch.tensor(LENGTHS)
        decode = SimpleNamespace(
            requires_padding=False,
            seq_lens=shard.local_length(lengths)[:, None],  # [B, 1], this rank's
            block_table=table,
        )
        # the prefill chunk: request 0's last 3 tokens, metadata from our CPU stand-in of
        # vLLM's BuildPrefillChunkMetadataKernel (local row bounds under DCP)
        ks, ke = torch.empty(3, dtype=torch.int32), torch.empty(3, dtype=torch.int32)
        local_len = shard.local_length(torch.tensor([LENGTHS[0]]))
        local_cu = torch.tensor([0, int(local_len)], dtype=torch.int32)
        cpu.build_prefill_chunk_metadata(  # by vLLM's kernel parameter names
            query_start_loc_ptr=torch.tensor([0, 3]),
            uncompressed_seq_lens_ptr=torch.tensor([LENGTHS[0]]),
            cu_compressed_seq_lens_ptr=torch.tensor([0, LENGTHS[0]]),
            row_start_cu_compressed_seq_lens_ptr=local_cu,
            token_to_seq_ptr=torch.empty(LENGTHS[0], dtype=torch.int32),
            cu_compressed_seq_len_ks_ptr=ks,
            cu_compressed_seq_len_ke_ptr=ke,
            query_slice_start=0,
            query_slice_stop=3,
            DCP_RANK=shard.rank,
            DCP_WORLD=shard.size,
            DCP_INTERLEAVE=shard.interleave,
        )
        chunk = SimpleNamespace(
            token_start=2,
            token_end=5,
            num_reqs=1,
            cu_seq_lens=torch.tensor([0, LENGTHS[0]]),
            local_cu_seq_lens=local_cu,
            cu_seqlen_ks=ks,
            cu_seqlen_ke=ke,
            block_table=table[:1],
        )
        meta = SimpleNamespace(
            num_decodes=2,
            num_decode_tokens=2,
            decode=decode,
            num_prefills=1,
            prefill=SimpleNamespace(chunks=[chunk]),
            max_seq_len=max(LENGTHS),
            slot_mapping=torch.full((5,), -1, dtype=torch.int64),  # keys already inserted
        )
        layer = SimpleNamespace(
            k_cache=SimpleNamespace(kv_cache=cache),
            scale_fmt="ue8m0",
            topk_tokens=topk,
            topk_indices_buffer=torch.full((8, topk), 7, dtype=torch.int32),
        )
        return layer, meta

    return (q, weights), build(NO_DCP), [build(DCPShard(n, r, interleave)) for r in range(n)]


@pytest.mark.parametrize(("n", "interleave"), SHARDS)
def test_the_indexer_under_dcp_selects_what_it_selects_without(n, interleave):
    """``select_dcp`` on every rank's shard (its keys, pages, localized metadata) writes
    DCP 1's ``select`` result on every rank: the same request positions, the same order.
    The logits of a key are the same computation on either layout (the oracle scores
    each token against its keys with the same ops), so the selection is exact."""
    from vllm_mla.vllm.sparse import indexer

    (q, weights), (layer1, meta1), ranks = indexer_step(n, interleave)
    hidden = torch.zeros(5, 8)
    want = indexer.select(layer1, hidden, q, None, weights, meta1, indexer.ReferenceKernels)
    want = want[:5].clone()
    group = Gather(n)
    for _ in range(2):  # pass 1 records the candidates, pass 2 merges them
        for r, (layer, meta) in enumerate(ranks):
            shard = DCPShard(n, r, interleave)
            got = indexer.select_dcp(
                layer, hidden, q, None, weights, meta, indexer.ReferenceKernels, shard, group
            )
    for layer, _ in ranks:
        assert torch.equal(layer.topk_indices_buffer[:5], want)
        assert (layer.topk_indices_buffer[5:] == 7).all()  # rows past the step untouched
    assert got is ranks[-1][0].topk_indices_buffer
    assert (want[:, : min(LENGTHS)] >= 0).all() and (want >= -1).all()


@pytest.mark.parametrize(("n", "interleave"), [(2, 1), (3, 2)])
def test_the_cuda_paths_dcp_selection_equals_its_selection_without(n, interleave):
    """The CUDA path (the Triton kernels, interpreted here; a static decode width past
    every length and row blocks of one token, as on a GPU): ``select_dcp`` on the shards
    equals ``select`` on the whole cache, and both equal the oracle's. The paged logits of
    a key are one program's computation on either layout, so the merge is exact."""
    pytest.importorskip("triton")
    from vllm_mla.vllm.sparse import indexer

    kernels = kernels_for(torch.device("cpu"), "triton")
    (q, weights), (layer1, meta1), ranks = indexer_step(n, interleave, seed=1)
    hidden = torch.zeros(5, 8)
    oracle = indexer.select(layer1, hidden, q, None, weights, meta1, indexer.ReferenceKernels)
    oracle = oracle[:5].clone()
    kw = dict(max_decode_len=256, budget_bytes=36 * 256)
    want = indexer.select(layer1, hidden, q, None, weights, meta1, kernels, **kw)[:5].clone()
    group = Gather(n)
    for _ in range(2):
        for r, (layer, meta) in enumerate(ranks):
            shard = DCPShard(n, r, interleave)
            indexer.select_dcp(layer, hidden, q, None, weights, meta, kernels, shard, group, **kw)
    assert torch.equal(want, oracle)
    for layer, _ in ranks:
        assert torch.equal(layer.topk_indices_buffer[:5], want)


def test_dcp_contexts_name_each_prefill_tokens_request_when_a_rank_holds_none_of_one():
    """A request with no positions on this rank repeats the previous start in
    ``local_cu_seq_lens``: its tokens (length 0 here) and the next request's are named
    without reading past the chunk's block table."""
    from vllm_mla.vllm.sparse import indexer

    table = torch.tensor([[3], [4], [5]], dtype=torch.int32)
    chunk = SimpleNamespace(
        token_start=0,
        token_end=4,
        num_reqs=3,
        local_cu_seq_lens=torch.tensor([0, 5, 5, 9], dtype=torch.int32),  # request 1: none
        cu_seqlen_ks=torch.tensor([0, 5, 5, 5], dtype=torch.int32),
        cu_seqlen_ke=torch.tensor([5, 5, 8, 9], dtype=torch.int32),
        block_table=table,
    )
    meta = SimpleNamespace(
        num_decodes=0,
        decode=None,
        num_prefills=1,
        prefill=SimpleNamespace(chunks=[chunk]),
        max_seq_len=20,
    )
    [(rows, tables, lengths, bound)] = indexer.dcp_contexts(meta, DCPShard(2, 1, 1))
    assert rows.tolist() == [0, 1, 2, 3] and lengths.tolist() == [5, 0, 3, 4]
    assert tables[:, 0].tolist() == [3, 5, 5, 5]  # token 1 (length 0) may name either
    assert bound == 10
