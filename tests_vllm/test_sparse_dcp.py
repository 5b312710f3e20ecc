"""B12X_MLA_SPARSE under decode context parallelism (DCP), on vLLM's own classes (CPU).

Each DCP rank is simulated in this process: vLLM's ``get_dcp_world_size_and_rank`` (what
``AttentionImplBase.__new__`` reads) answers ``(N, rank)`` while the rank's impl is built
under a real ``VllmConfig`` with ``decode_context_parallel_size=N``. One KV set (two
requests) is laid out whole (DCP 1) and sharded the way vLLM's slot mapping shards it
(runs of ``cp_kv_cache_interleave_size`` positions round robin, each rank its own pages and
block table); the indexer's top-k holds request positions (what vLLM's DCP indexer
writes). Every rank runs ``forward_mqa`` on the gathered query heads (``N x H``, as
``dcp_manager.query_gather`` hands them over) and its own cache; vLLM's own LSE combine
(``_lse_weighted_combine``, its torch reference of the ``ag_rs``/``a2a`` merges) must give
DCP 1's output.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch
from test_sparse_backend import TOPK, builder_config, make_impl
from test_sparse_backend import cpu_session as cpu_session  # the fixture, re-exported
from vllm_layers import vllm_config

from vllm_mla.ops.dcp import DCPShard, lse_merge
from vllm_mla.ops.sparse_mla import pack_rows
from vllm_mla.vllm.sparse import impl as impl_mod
from vllm_mla.vllm.sparse.backend import B12XMLASparseBackend
from vllm_mla.vllm.sparse.impl import B12XMLASparseImpl

H, BLOCK = 3, 64  # heads per rank; the cache's page rows
LENGTHS = (150, 90)  # two requests
TOKEN_REQUEST = (0, 0, 1, 1)
KV = {"fp8_ds_mla": "fp8_ds_mla", "bfloat16": "bf16"}
U = 2.0**-24  # fp32 unit roundoff


@contextlib.contextmanager
def dcp_config(monkeypatch, n: int, rank: int, interleave: int = 1, dtype=torch.bfloat16):
    """The shared VllmConfig with DCP ``n`` (``cp_kv_cache_interleave_size``, model dtype,
    64-row pages), current, and vLLM's DCP group answering ``(n, rank)``; restored
    afterwards."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    config = vllm_config()
    with monkeypatch.context() as m:
        m.setattr(config.parallel_config, "decode_context_parallel_size", n)
        m.setattr(config.parallel_config, "cp_kv_cache_interleave_size", interleave)
        m.setattr(config.model_config, "dtype", dtype)
        m.setattr(config.cache_config, "block_size", BLOCK)
        m.setattr(
            parallel_state,
            "get_dcp_world_size_and_rank",
            lambda enabled=True: (n, rank) if enabled and n > 1 else (1, 0),
        )
        with set_current_vllm_config(config):
            yield config


def build_impl(
    num_heads: int, kv_cache_dtype: str, buffer: torch.Tensor, sinks: torch.Tensor | None = None
) -> B12XMLASparseImpl:
    extra = {} if sinks is None else {"sinks": sinks}
    return make_impl(kv_cache_dtype, buffer=buffer, num_heads=num_heads, **extra)


def dcp_group_of(monkeypatch, full_sinks: torch.Tensor, n: int) -> None:
    """``get_dcp_group().all_gather`` of a rank's sinks: every rank's, in rank order (a
    group of ``n`` ranks holding ``full_sinks`` in head shards)."""
    import vllm.distributed as dist

    def all_gather(x, dim):
        assert dim == 0 and x.shape[0] * n == full_sinks.shape[0]
        return full_sinks.clone()

    monkeypatch.setattr(dist, "get_dcp_group", lambda: SimpleNamespace(all_gather=all_gather))


# -- selection and start-up --------------------------------------------------------------
def selector_reasons(backend, capability) -> list[str]:
    """What vLLM's CUDA selector asks a backend under DCP (``get_attn_backend_cls``:
    ``validate_configuration(device_capability=, **AttentionSelectorConfig._asdict())``)."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    selector = AttentionSelectorConfig(
        head_size=576,
        dtype=torch.bfloat16,
        kv_cache_dtype="fp8_ds_mla",
        block_size=64,
        use_mla=True,
        use_sparse=True,
        use_dcp=True,
    )
    return backend.validate_configuration(
        device_capability=DeviceCapability(*capability), **selector._asdict()
    )


def test_the_selector_keeps_ours_eligible_under_dcp_as_flashmla_sparse(monkeypatch):
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.rocm_aiter_mla_sparse import ROCMAiterMLASparseBackend

    with dcp_config(monkeypatch, 2, 0) as config:  # a DSA model: index_topk set
        monkeypatch.setattr(config.model_config.hf_text_config, "index_topk", TOPK, raising=False)
        for capability in ((8, 0), (9, 0), (12, 0)):
            assert selector_reasons(B12XMLASparseBackend, capability) == []
        assert "DCP not supported" not in selector_reasons(FlashMLASparseBackend, (9, 0))
        # control: a sparse backend without DCP
        assert "DCP not supported" in selector_reasons(ROCMAiterMLASparseBackend, (9, 0))
    assert B12XMLASparseBackend.supports_dcp() and FlashMLASparseBackend.supports_dcp()


def test_vllms_start_up_check_accepts_our_impl_under_dcp(monkeypatch, cpu_session):
    """``check_attention_cp_compatibility`` (what stopped DCP at worker start-up:
    "DCP requires attention implementations to return the softmax LSE during decode")
    on our impl, built as vLLM builds it on a DCP rank."""
    from vllm.v1.worker import cp_utils

    buffer = torch.full((8, TOPK), -1, dtype=torch.int32)
    with dcp_config(monkeypatch, 2, 1, interleave=16) as config:
        impl = build_impl(H, "fp8_ds_mla", buffer)
        layers = {"l0": SimpleNamespace(impl=impl, get_attn_backend=lambda: B12XMLASparseBackend)}
        monkeypatch.setattr(cp_utils, "get_layers_from_vllm_config", lambda *a, **k: layers)
        cp_utils.check_attention_cp_compatibility(config)  # passes
        # MTP with interleave 16 (vLLM asks supports_mtp_with_cp_non_trivial_interleave_size)
        monkeypatch.setattr(config, "speculative_config", SimpleNamespace(method="mtp"))
        cp_utils.check_attention_cp_compatibility(config)
        monkeypatch.setattr(config, "speculative_config", None)
        control = SimpleNamespace(dcp_world_size=2, need_to_return_lse_for_decode=False)
        layers["l0"] = SimpleNamespace(impl=control, get_attn_backend=lambda: None)
        with pytest.raises(AssertionError, match="return the softmax LSE during decode"):
            cp_utils.check_attention_cp_compatibility(config)
    assert impl.need_to_return_lse_for_decode and impl.lse_base_on_e  # set by vLLM's __new__
    assert impl.dcp == DCPShard(2, 1, 16)
    caps = impl.caps
    assert caps.num_heads == 2 * H and caps.return_lse and caps.dcp  # the gathered heads


def test_dcp_with_speculative_decoding_builds_the_dcp_impl(monkeypatch, cpu_session):
    """DCP together with speculative decoding is served (tests_e2e/test_topology.py runs
    MTP 3 and ngram under DCP in engines): the impl builds with its DCP caps."""
    buffer = torch.full((8, TOPK), -1, dtype=torch.int32)
    with dcp_config(monkeypatch, 2, 0) as config:
        monkeypatch.setattr(config, "speculative_config", SimpleNamespace(method="mtp"))
        impl = build_impl(H, "fp8_ds_mla", buffer)
    assert impl.dcp == DCPShard(2, 0, 1) and impl.caps.dcp and impl.caps.num_heads == 2 * H


def test_b12x_declines_dcp_and_triton_serves(monkeypatch, cpu_session, caplog):
    """b12x is not asked to serve DCP (its empty-row contract, the merge's identity, is
    unverified): the plan is Triton's, and the metadata builder allocates no physical
    rows for it."""
    from vllm_mla.ops.sparse_mla import api as sparse_api
    from vllm_mla.vllm.sparse import metadata

    assert impl_mod.serving_impl("b12x", 2) == "triton"
    assert impl_mod.serving_impl("b12x", 1) == "b12x"
    assert impl_mod.serving_impl("reference", 2) == "reference"
    monkeypatch.setattr(sparse_api, "select_impl", lambda device: "b12x")
    buffer = torch.full((8, TOPK), -1, dtype=torch.int32)
    with dcp_config(monkeypatch, 2, 0), caplog.at_level(logging.INFO, logger="vllm_mla"):
        impl = build_impl(H, "fp8_ds_mla", buffer)
        impl._bind_plan(torch.device("cpu"))
    assert impl.plan.impl == "triton" and impl.plan.caps.dcp
    assert "b12x declines DCP" in caplog.text
    monkeypatch.setattr(metadata, "select_impl", lambda device: "b12x")
    spec = SimpleNamespace(block_size=BLOCK)
    for dcp, allocated in ((1, True), (2, False)):
        config = builder_config()
        config.parallel_config.decode_context_parallel_size = dcp
        builder = metadata.B12XMLASparseMetadataBuilder(spec, ["l0"], config, "cpu")
        assert (builder.physical_indices_buffer is not None) == allocated


# -- the impl's DCP contract: per rank, merged by vLLM's combine --------------------------
def records(n: int, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """Packed rows on binary grids: every dot of these q and keys is exact in fp32."""
    kv_c = torch.randint(-7, 8, (n, 512), generator=gen) / 8
    kv_c[:, ::128] = 7 / 8  # power-of-two fp8 group scales
    k_pe = torch.randint(-8, 9, (n, 64), generator=gen) / 8
    return pack_rows(kv_c, k_pe, fmt)


def place(rows_of: list[torch.Tensor], gen: torch.Generator):
    """(cache [pages, 64, W], block table int32 [R, W]): shuffled pages, one spare."""
    pages = [-(-r.shape[0] // BLOCK) for r in rows_of]
    order = torch.randperm(sum(pages) + 1, generator=gen)
    cache = torch.zeros(sum(pages) + 1, BLOCK, rows_of[0].shape[1], dtype=rows_of[0].dtype)
    table = torch.zeros(len(rows_of), max(pages), dtype=torch.int32)
    used = 0
    for req, rows in enumerate(rows_of):
        for p in range(pages[req]):
            page = int(order[used])
            used += 1
            table[req, p] = page
            chunk = rows[p * BLOCK : (p + 1) * BLOCK]
            cache[page, : chunk.shape[0]] = chunk
    return cache, table


def topk_buffer(seed: int = 0) -> torch.Tensor:
    """The indexer's buffer: per token up to TOPK request positions of its request, -1."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((8, TOPK), -1, dtype=torch.int32)
    for t, req in enumerate(TOKEN_REQUEST):
        picked = torch.randperm(LENGTHS[req], generator=gen)[: TOPK - 9 * t]
        buf[t, : picked.numel()] = picked.int()
    return buf


def forward(impl, q, cache, table):
    meta = SimpleNamespace(
        req_id_per_token=torch.tensor(TOKEN_REQUEST, dtype=torch.int32),
        block_table=table,
        block_size=BLOCK,
        num_decode_tokens=q.shape[0],
    )
    return impl.forward_mqa(q, cache, meta, layer=None)


@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
@pytest.mark.parametrize("interleave", [1, 16])
@pytest.mark.parametrize("kv_cache_dtype", KV)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranks_merged_by_vllms_combine_equal_dcp1(
    monkeypatch, cpu_session, dtype, kv_cache_dtype, interleave, sink
):
    """With HY-V4's sink each rank's layer holds its heads' sinks; the merged softmax
    counts the group's sinks once (``impl.dcp_sinks``), as DCP 1 with every head does."""
    from vllm.v1.attention.ops.dcp import _lse_weighted_combine, mask_dcp_empty_shards_

    n, fmt = 2, KV[kv_cache_dtype]
    gen = torch.Generator().manual_seed(interleave)
    rows = [records(length, fmt, gen) for length in LENGTHS]
    buffer = topk_buffer()
    tokens = len(TOKEN_REQUEST)
    q = (torch.randint(-8, 9, (tokens, n * H, 576), generator=gen) / 4).to(dtype)
    sinks = (torch.randn(n * H, generator=gen) + 2).float() if sink else None
    if sink:
        dcp_group_of(monkeypatch, sinks, n)
    with dcp_config(monkeypatch, 1, 0, dtype=dtype):
        whole = build_impl(n * H, kv_cache_dtype, buffer, sinks)  # DCP 1 with every head
        want, none = forward(whole, q, *place(rows, gen))
    assert none is None  # no DCP: no lse
    outs, lses = [], []
    for rank in range(n):
        shard = DCPShard(n, rank, interleave)
        local = [r[shard.to_local(torch.arange(r.shape[0])) >= 0] for r in rows]
        with dcp_config(monkeypatch, n, rank, interleave, dtype=dtype):
            local_sinks = None if sinks is None else sinks[rank * H : (rank + 1) * H]
            impl = build_impl(H, kv_cache_dtype, buffer, local_sinks)  # this rank's H heads
            out, lse = forward(impl, q, *place(local, gen))
        assert out.shape == (tokens, n * H, 512) and out.dtype == dtype
        assert lse.shape == (tokens, n * H) and lse.dtype == torch.float32
        assert lse.is_contiguous() and torch.isfinite(lse).all()
        before = lse.clone()  # vLLM's empty-shard mask (global seq lens): nothing to mask
        starts = torch.arange(tokens + 1, dtype=torch.int32)
        mask_dcp_empty_shards_(lse, torch.tensor([150, 150, 90, 90]), starts)
        assert torch.equal(lse, before)
        outs.append(out.float())
        lses.append(lse)
    merged = _lse_weighted_combine(torch.stack(outs), torch.stack(lses))
    # our torch reference of that merge (benchmarks, tests/test_sparse_dcp.py) is vLLM's
    ours, _ = lse_merge(torch.stack(outs), torch.stack(lses))
    assert torch.equal(ours, merged)
    # Error model. The logits are exact (binary grids), so DCP 1 and the ranks differ only
    # in the softmax: the exps and the K-term sums of weights and values, <= (2K + 64) u of
    # M = max |value| (7/8 here) for each side and the merge's few roundings (64 is a 2x
    # slack over exp, the division, lse_r, exp(lse_r - lse), the merge's sum). A bf16 model
    # also rounds each rank's output and DCP 1's to bf16 (unit roundoff 2**-8): <= 2**-8
    # of |out_r| each (the merge weights sum to 1), <= 2**-8 of |DCP 1|.
    fp32 = 2 * (2 * TOPK + 64) * U * (7 / 8)
    rounding = 0.0
    if dtype == torch.bfloat16:
        rounding = 2.0**-8 * (want.float().abs() + torch.stack(outs).abs().amax(0))
    err = (merged - want.float()).abs()
    assert (err <= fp32 + rounding).all(), float((err - fp32 - rounding).max())


# -- the portable indexer on vLLM's SparseAttnIndexer ----------------------------------
@pytest.mark.parametrize("forward", ["forward_cpu", "forward_cuda"])
def test_the_portable_indexer_serves_dcp_itself(monkeypatch, forward):
    """Built on a DCP rank (vLLM's constructor reads its rank from the DCP group), ours
    keeps DCP (PCP still goes to vLLM's methods) and selects through ``select_dcp`` with
    this rank's shard, the interleave read from vLLM's parallel config at the first step,
    and vLLM's DCP group for the candidate all-gather."""
    import importlib

    import vllm.distributed
    from test_sparse_indexer_portable import construct

    from vllm_mla.vllm import telemetry
    from vllm_mla.vllm.sparse import indexer

    module = importlib.import_module(indexer.BASE_MODULE)
    monkeypatch.setattr(module, "get_dcp_group", lambda: SimpleNamespace(rank_in_group=1))
    group = SimpleNamespace(name="the DCP group")
    monkeypatch.setattr(vllm.distributed, "get_dcp_group", lambda: group)
    with dcp_config(monkeypatch, 2, 1, interleave=4) as config:
        made = construct(indexer.make_indexer(), config)
    assert (made.dcp_world_size, made.dcp_rank) == (2, 1) and not indexer._delegates(made)
    calls = []
    monkeypatch.setattr(indexer, "_forward_context_metadata", lambda layer: "meta")
    monkeypatch.setattr(indexer, "select_dcp", lambda *a, **k: calls.append((a, k)) or "topk")
    monkeypatch.setattr(indexer, "select", lambda *a, **k: pytest.fail("DCP 1's select ran"))
    kernels = {indexer.CPU: indexer.ReferenceKernels, indexer.CUDA: "triton kernels"}
    monkeypatch.setattr(indexer, "kernels_for", kernels.__getitem__)
    made.vllm_mla_ours = True  # forward_cuda: where the CUDA indexer is ours
    telemetry.reset()
    with dcp_config(monkeypatch, 2, 1, interleave=4):
        assert getattr(made, forward)(torch.zeros(2, 8), "q", "k", "w") == "topk"
    ((args, kwargs),) = calls
    assert args[5] == "meta" and args[7] == DCPShard(2, 1, 4) and args[8] is group
    if forward == "forward_cpu":
        assert args[6] is indexer.ReferenceKernels and kwargs == {}
        assert telemetry.snapshot()["sparse"] == {"indexer:cpu:dcp": 1}
    else:
        assert args[6] == "triton kernels" and kwargs["max_decode_len"] == 256
        assert telemetry.snapshot()["sparse"] == {"indexer:triton:dcp": 1}
    made.use_pcp = True
    assert indexer._delegates(made)  # PCP: vLLM's own methods


# -- vLLM CPU's DCP kernels: our torch stand-ins through vLLM's own launchers ------------
def test_the_lse_correction_through_vllms_launcher_is_vllms_combine():
    """``cpu_dcp`` installed, vLLM's ``correct_attn_out`` (the ``ag_rs`` combine's
    correction, then a sum over ranks: what its reduce-scatter does) equals vLLM's torch
    reference ``_lse_weighted_combine``; a rank with -inf (an empty shard) drops out."""
    from vllm.v1.attention.ops import dcp

    from vllm_mla.vllm.sparse import cpu_dcp

    assert "torch" in cpu_dcp.install()  # vLLM CPU without Triton
    gen = torch.Generator().manual_seed(0)
    n, tokens, heads, width = 3, 4, 5, 512
    outs = torch.randn(n, tokens, heads, width, generator=gen)
    lses = torch.randn(n, tokens, heads, generator=gen) * 3
    lses[1, 0] = float("-inf")  # rank 1 holds none of token 0's selection
    lses[:, 1, 2] = float("-inf")  # nobody does: out 0
    want, want_lse = dcp._lse_weighted_combine(outs, lses, return_lse=True)
    total = torch.zeros_like(want)
    for rank in range(n):
        corrected, lse = dcp.correct_attn_out(outs[rank].clone(), lses, rank, None)
        total += corrected
    # fp32, the same formula in another order: exp/log roundings of |lse| <= ~10 and a
    # 3-term sum, each <= 2**-24 relative; 1e-5 of the output's magnitude covers them
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=1e-5, rtol=1e-5)
    assert (total[1, 2] == 0).all() and torch.isneginf(lse[1, 2])


def test_install_names_a_kernel_this_vllm_lacks(monkeypatch):
    """A stand-in whose vLLM kernel is absent is not registered, and the outcome says so
    (vLLM 0.34 has no ComputeSlotMappingKernel; the name is faked absent elsewhere)."""
    from vllm_mla.vllm.sparse import cpu_dcp, kernel_targets

    monkeypatch.setattr(cpu_dcp, "_installed", None)
    real = kernel_targets.kernel_at
    monkeypatch.setattr(
        kernel_targets, "kernel_at", lambda p: None if p == cpu_dcp.SLOT_KERNEL else real(p)
    )
    registered = {}
    import vllm.triton_utils.dispatcher as dispatcher

    monkeypatch.setattr(dispatcher, "register_kernels", registered.update)
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", False)
    outcome = cpu_dcp.install()
    assert set(registered) == {cpu_dcp.COMBINE_KERNEL}
    assert f"not overridden: {cpu_dcp.SLOT_KERNEL}" in outcome


@pytest.mark.parametrize(("n", "rank", "interleave"), [(2, 0, 1), (2, 1, 1), (4, 3, 16)])
def test_the_slot_mapping_through_vllms_launcher_shards_like_the_indexer(n, rank, interleave):
    """``cpu_dcp`` installed, vLLM's ``ComputeSlotMappingKernel`` launch under DCP: a token
    another rank holds gets PAD (-1), one this rank holds the slot of its local position
    (``DCPShard.to_local``) in this rank's block table, the rest of the buffer PAD."""
    from vllm_mla.vllm.sparse import cpu_dcp

    block_table = pytest.importorskip(
        "vllm.v1.worker.block_table",
        reason="vLLM 0.34 has no ComputeSlotMappingKernel (its x86 CPU runs the GPU model "
        "runner's Triton block table through triton-cpu): nothing to override",
    )
    _COMPUTE_SLOT_MAPPING_KERNEL = block_table._COMPUTE_SLOT_MAPPING_KERNEL
    cpu_dcp.install()
    shard = DCPShard(n, rank, interleave)
    query_start = torch.tensor([0, 5, 12], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 60, 61, 62, 63, 64, 65, 200], dtype=torch.int64)
    table = torch.tensor([[7, 3, 9, 0], [4, 8, 2, 6]], dtype=torch.int32)
    slots = torch.full((16,), 12345, dtype=torch.int64)
    _COMPUTE_SLOT_MAPPING_KERNEL(
        2, 12, 16, query_start, positions, table, table.stride(0), slots, 64, n, rank, interleave
    )
    request = torch.tensor([0] * 5 + [1] * 7)
    local = shard.to_local(positions)
    want = torch.where(
        local >= 0, table[request, (local // 64).clamp(min=0)].long() * 64 + local % 64, -1
    )
    assert slots[:12].tolist() == want.tolist() and (slots[12:] == -1).all()
