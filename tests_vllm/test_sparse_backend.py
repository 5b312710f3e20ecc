"""B12X_MLA_SPARSE inside vLLM 0.33 (CPU): registration, cache dtype, validation, owners."""

from __future__ import annotations

import gc
import logging
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import mla_layer, model_with, reload_through_vllm
from vllm.model_executor.layers.attention import mla_attention
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm_layers import post_load

from vllm_mla.ops.sparse_mla import PreparationSession, pack_rows
from vllm_mla.ops.sparse_mla.formats import unpack_records
from vllm_mla.vllm import plugin
from vllm_mla.vllm.sparse import impl as impl_mod
from vllm_mla.vllm.sparse import registration
from vllm_mla.vllm.sparse.backend import B12XMLASparseBackend
from vllm_mla.vllm.sparse.impl import B12XMLASparseImpl

H, TOPK, BLOCK = 3, 128, 64


def canonical(backend, dtype):
    return mla_attention._canonicalize_sparse_mla_kv_cache_dtype(backend, dtype)


# -- registration ---------------------------------------------------------------------
def test_registered_by_name_and_custom_left_free(registered):
    assert AttentionBackendEnum["B12X_MLA_SPARSE"].get_class() is B12XMLASparseBackend
    assert not registration.selects_ours(AttentionBackendEnum.CUSTOM)  # not claimed
    assert "carried as CUSTOM" in registered["sparse"]
    assert "and CUSTOM" not in registered["sparse"]


def test_custom_claimed_when_the_user_opts_in(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_SPARSE_CUSTOM", "1")
    plugin.reset()
    monkeypatch.setenv("VLLM_MLA_SPARSE_CUSTOM", "1")  # reset drops a claim it exported
    try:
        result = plugin.register()
        assert AttentionBackendEnum.CUSTOM.get_class() is B12XMLASparseBackend
        assert "and CUSTOM (VLLM_MLA_SPARSE_CUSTOM=1)" in result["sparse"]
    finally:
        plugin.reset()


def test_claiming_custom_exports_it_to_later_processes(registered, monkeypatch):
    import os

    monkeypatch.delenv("VLLM_MLA_SPARSE_CUSTOM", raising=False)
    assert registration.claim_custom() is None
    assert registration.selects_ours(AttentionBackendEnum.CUSTOM)
    assert os.environ["VLLM_MLA_SPARSE_CUSTOM"] == "1"  # what spawned processes inherit
    registration.unregister_custom()
    assert "VLLM_MLA_SPARSE_CUSTOM" not in os.environ


def test_double_registration_is_a_no_op(registered):
    assert "already" in registration.register()
    plugin._result = None
    assert plugin.register()["sparse"].startswith("applied")
    # control: vLLM itself raises on a second registration of the name
    with pytest.raises(ValueError, match="already exists"):
        register_backend("B12X_MLA_SPARSE", registration.CLASS_PATH)


def test_start_up_line_names_the_custom_fallback(monkeypatch, caplog):
    monkeypatch.delenv("VLLM_MLA_FEATURES", raising=False)
    plugin.reset()
    with caplog.at_level(logging.DEBUG, logger="vllm_mla"):
        plugin.register()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("sparse backend: --attention-backend B12X_MLA_SPARSE" in m for m in info)
    assert "vllm_mla.register()" in caplog.text and "'backend': 'CUSTOM'" in caplog.text  # DEBUG


def test_custom_owned_by_another_plugin_is_left_alone(registered, monkeypatch):
    registration.unregister_custom()
    register_backend(AttentionBackendEnum.CUSTOM, "other.plugin.Backend")
    monkeypatch.setenv("VLLM_MLA_SPARSE_CUSTOM", "1")
    try:
        assert "CUSTOM is taken by other.plugin.Backend" in registration.register()
        assert registration.claim_custom() == "other.plugin.Backend"
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()


# -- cache dtype ----------------------------------------------------------------------
def test_fp8_resolves_to_fp8_ds_mla_for_ours_only_and_auto_stays(registered):
    """As upstream's FLASHMLA_SPARSE: only quantized requests become fp8_ds_mla; ``auto``
    stays the model dtype (a user asking for bf16 never gets fp8)."""
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (
        FlashInferMLASparseTRTLLMBackend as Other,
    )

    for dtype in ("fp8", "fp8_e4m3"):
        assert canonical(B12XMLASparseBackend, dtype) == "fp8_ds_mla"
        assert canonical(Other, dtype) == dtype  # another backend: unchanged
    assert canonical(B12XMLASparseBackend, "auto") == "auto"
    assert canonical(B12XMLASparseBackend, "bfloat16") == "bfloat16"
    assert canonical(B12XMLASparseBackend, "nvfp4_ds_mla") == "nvfp4_ds_mla"  # kept as is
    registration.claim_custom()
    assert canonical(AttentionBackendEnum.CUSTOM.get_class(), "fp8") == "fp8_ds_mla"


def test_control_without_the_patch_auto_stays_auto(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_FEATURES", "lifecycle")
    plugin.reset()
    plugin.register()
    assert canonical(B12XMLASparseBackend, "fp8") == "fp8"


# -- class-level validation -----------------------------------------------------------
def validate(
    head=576, dtype=torch.bfloat16, kv="fp8_ds_mla", block=64, sparse=True, cap=(12, 0), **kw
):
    return B12XMLASparseBackend.validate_configuration(
        head,
        dtype,
        kv,
        block,
        True,
        False,
        sparse,
        False,
        False,
        DeviceCapability(*cap),
        "decoder",
        **kw,
    )


@pytest.mark.parametrize("kv", ["fp8_ds_mla", "bfloat16", "auto", "fp8", "nvfp4_ds_mla"])
@pytest.mark.parametrize("block", [64, 128, 256])
@pytest.mark.parametrize("cap", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 1)])
def test_validate_accepts_what_it_serves(kv, block, cap):
    assert validate(kv=kv, block=block, cap=cap) == []
    assert validate(kv=kv, block=block, cap=cap, use_dcp=True) == []  # DCP: served


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"head": 320}, "head_size not supported"),  # 576 and 512 (no RoPE) are served
        ({"dtype": torch.float16}, "dtype not supported"),
        ({"kv": "fp8_e5m2"}, "kv_cache_dtype not supported"),
        ({"block": 32}, "block_size not supported"),
        ({"block": 16}, "block_size not supported"),
        ({"sparse": False}, "non-sparse not supported"),
        ({"cap": (7, 5)}, "compute capability not supported"),
        ({"use_pcp": True}, "PCP not supported"),
    ],
)
def test_validate_rejects_with_a_reason(change, reason):
    assert reason in validate(**change)


def test_blocks_are_aligned_to_64_row_pages():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
    )
    aligned = B12XMLASparseBackend.customize_spec(spec)
    assert aligned.block_stride_alignment == 64 * spec.state_content_size_bytes


# -- impl: flags and owners -----------------------------------------------------------
def numpy_buffer(rows=8):
    backing = np.full((rows, TOPK), -1, dtype=np.int32)
    return torch.from_numpy(backing), weakref.ref(backing)


def make_impl(kv_cache_dtype="fp8_ds_mla", indexer=None, buffer=None, num_heads=H, **extra):
    return B12XMLASparseImpl(
        num_heads,
        576,
        576**-0.5,
        1,
        None,
        None,
        kv_cache_dtype,
        None,
        "decoder",
        None,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        qk_head_dim=192,
        v_head_dim=128,
        kv_b_proj=torch.nn.Linear(2, 2),
        indexer=indexer,
        topk_indices_buffer=buffer,
        **extra,
    )


def test_impl_flags_and_hooks():
    impl = make_impl(buffer=numpy_buffer()[0])
    assert impl.is_sparse and not impl.supports_dense_mha_prefill
    assert not impl.supports_quant_query_input and not impl.supports_pcp
    assert not B12XMLASparseBackend.supports_pcp() and B12XMLASparseBackend.supports_dcp()
    assert impl.can_return_lse_for_decode and impl.lse_base_on_e
    assert not impl.need_to_return_lse_for_decode  # no DCP group here: vLLM asks for none
    impl.record_logical_topk_ready()
    impl.prepare_for_batch(None)
    assert impl.index_group is None  # the layer then builds no HiSparse cache handle


def test_no_group_conversion_buffers_or_events():
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroupBuilder

    from vllm_mla.memory import AllocationTrace

    buf = numpy_buffer()[0]
    builder = SparseMLAIndexGroupBuilder(buf)
    with AllocationTrace("cpu") as trace:
        make_impl(
            indexer=SimpleNamespace(topk_indices_buffer=buf),
            buffer=buf,
            index_group_builder=builder,
        )
    assert builder.current_group is None
    assert sum(a.size for a in trace.allocations() if not a.freed) < 1024  # no rows x topk
    # control: what SparseMLACommonImpl.__init__ does with the same builder
    import inspect

    width = {"head_size": 576}  # vLLM 0.32 / 0.33; 0.34 names the record's width
    if "row_width" in inspect.signature(builder.register_layer).parameters:
        width = {"row_width": 656}
    with AllocationTrace("cpu") as trace:
        builder.register_layer(True, None, **width, kv_cache_dtype="fp8_ds_mla")
    assert builder.current_group is not None
    assert sum(a.size for a in trace.allocations() if not a.freed) >= 9 * TOPK * 4


def test_no_shadow_selection_buffer_when_the_indexer_owns_it():
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SharedTopkIndicesBuffer,
    )

    draft, draft_alive = numpy_buffer()
    indexer = SimpleNamespace(topk_indices_buffer=draft)
    impl = make_impl(indexer=indexer, buffer=draft)
    upstream = SharedTopkIndicesBuffer()  # control: vLLM's mixin keeps both
    upstream.init_topk_indices_buffer(indexer, draft)
    target = numpy_buffer()[0]
    indexer.topk_indices_buffer = target  # MTP re-points the draft indexer
    del draft
    gc.collect()
    assert draft_alive() is not None  # held by the upstream mixin's fallback field
    del upstream
    gc.collect()
    assert draft_alive() is None  # ours held only the indexer
    assert impl.topk_indices_buffer is target


def test_fp8_without_the_patch_is_refused_with_a_hint():
    with pytest.raises(NotImplementedError, match="--kv-cache-dtype fp8_ds_mla"):
        make_impl(kv_cache_dtype="fp8", buffer=numpy_buffer()[0])


# -- forward_mqa on CPU ---------------------------------------------------------------
def pack_fp8(kv_c, k_pe):
    """fp8_ds_mla records with unit scales (values chosen exactly representable)."""
    rows = kv_c.shape[0]
    out = torch.empty(rows, 656, dtype=torch.uint8)
    out[:, :512] = kv_c.to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, 512:528] = torch.ones(rows, 4).view(torch.uint8)
    out[:, 528:] = k_pe.bfloat16().view(torch.uint8)
    return out


def reference(q_full, kv, physical, scale):
    """Plain torch over decoded rows ``kv [rows, 576]`` fp32; -1 rows masked."""
    rows = kv[physical.long().clamp(min=0)]
    scores = torch.einsum("thd,tkd->thk", q_full.float(), rows) * scale
    scores = scores.masked_fill((physical < 0)[:, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)  # an empty row gives 0
    return torch.einsum("thk,tkd->thd", probs, rows[..., :512])


def decode(cache, kv_format):
    """Records of a ``[blocks, 64, W]`` cache -> fp32 ``[rows, 576]`` (the format's codec)."""
    kv_c, k_pe = unpack_records(cache.reshape(-1, cache.shape[-1]), kv_format)
    return torch.cat([kv_c, k_pe], -1)


class SpyKernel:
    """Records the indices that reached the kernel; decodes the cache it was given."""

    def __init__(self):
        self.indices = []

    select_impl = staticmethod(lambda device: "reference")
    scratch_bytes = staticmethod(lambda t, h, k, *, kv_format: t * h * 1024)

    def sparse_mla_forward(
        self,
        q,
        kv_cache,
        indices,
        scale,
        *,
        kv_format,
        lengths=None,
        out=None,
        scratch=None,
        return_lse=False,
        impl="auto",
    ):
        self.indices.append(indices.clone())
        rows = decode(kv_cache, kv_format)
        return reference(torch.cat(q, -1), rows, indices, scale).bfloat16(), None


@pytest.fixture
def cpu_session(monkeypatch):
    impl_mod.reset_sessions()
    yield
    impl_mod.reset_sessions()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "bfloat16", "nvfp4_ds_mla"])
def test_forward_mqa_converts_logical_to_physical_rows(cpu_session, kv_cache_dtype, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    blocks = 4
    kv_c = (torch.randint(-8, 8, (blocks * BLOCK, 512), generator=gen) / 4).float()
    k_pe = torch.randn(blocks * BLOCK, 64, generator=gen).bfloat16().float()
    decoded = torch.cat([kv_c, k_pe], -1)
    if kv_cache_dtype == "fp8_ds_mla":
        cache = pack_fp8(kv_c, k_pe).view(blocks, BLOCK, 656)
    elif kv_cache_dtype == "nvfp4_ds_mla":  # what the records hold (e2m1 is lossy)
        cache = pack_rows(kv_c, k_pe, kv_cache_dtype).view(blocks, BLOCK, 352)
        decoded = decode(cache, kv_cache_dtype)
    else:
        cache = decoded.bfloat16().view(blocks, BLOCK, 576)
    converted = []
    real_convert = impl_mod.convert_to_physical

    def recording(*args, **kwargs):
        converted.append(real_convert(*args, **kwargs))
        return converted[-1]

    monkeypatch.setattr(impl_mod, "convert_to_physical", recording)

    buf = torch.full((8, TOPK), -1, dtype=torch.int32)
    buf[0, :3] = torch.tensor([0, 65, 3])  # request 1 (blocks 3, 1)
    buf[1, :2] = torch.tensor([63, 64])  # request 0 (blocks 2, 0)
    buf[2, :1] = torch.tensor([130])  # request 0: block 2 of the table is past its end
    impl = make_impl(kv_cache_dtype, indexer=SimpleNamespace(topk_indices_buffer=buf), buffer=buf)
    metadata = SimpleNamespace(
        req_id_per_token=torch.tensor([1, 0, 0], dtype=torch.int32),
        block_table=torch.tensor([[2, 0], [3, 1]], dtype=torch.int32),
        block_size=BLOCK,
        num_decode_tokens=3,
    )
    q_full = torch.randn(3, H, 576, generator=gen).bfloat16()
    q = (q_full[..., :512], q_full[..., 512:])  # strided, as vLLM passes it
    out, lse = impl.forward_mqa(q, cache, metadata, layer=None)

    expected_rows = torch.full((3, TOPK), -1, dtype=torch.int32)
    expected_rows[0, :3] = torch.tensor([3 * 64 + 0, 1 * 64 + 1, 3 * 64 + 3])
    expected_rows[1, :2] = torch.tensor([2 * 64 + 63, 0 * 64 + 0])
    assert torch.equal(converted[-1], expected_rows)
    # out: sparse_mla_reference's fp32 in bf16 (<= 2**-8 relative; rtol 2e-2 leaves 5x) vs
    # this einsum's order: 576-term logits within 2 * 576 * 2**-24 * sum|q k| / 24 (<= 2e-3
    # here), times sum w|v| <= 2, twice (logit and normaliser): <= 7e-3 (atol 2e-2 leaves 3x)
    torch.testing.assert_close(
        out.float(), reference(q_full, decoded, expected_rows, 576**-0.5), atol=2e-2, rtol=2e-2
    )
    assert lse is None and out.shape == (3, H, 512)
    # the call keeps no reference to the pool (a weak one only): dropping it frees it
    pool = weakref.ref(cache)
    del cache
    assert pool() is None


def test_scratch_comes_from_vllms_workspace_and_lock_freezes(cpu_session, monkeypatch):
    from vllm.v1.worker import workspace

    if not torch.accelerator.is_available():
        # vLLM 0.32's workspace resize returns freed GPU memory with
        # torch.accelerator.empty_cache(), which raises without an accelerator
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)

    kernel = SpyKernel()
    impl_mod._sessions[torch.device("cpu")] = PreparationSession("cpu", kernel=kernel)
    impl = make_impl("bfloat16", buffer=torch.full((8, TOPK), -1, dtype=torch.int32))
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        impl.process_weights_after_loading(torch.bfloat16)
        impl.reserve_workspace()  # the profile run
        manager = workspace.current_workspace_manager()
        # the scratch and the output buffer [max_tokens, H, 512] (bf16), side by side
        out_bytes = impl.caps.max_tokens * H * 512 * 2
        assert manager._current_workspaces[0].numel() >= impl.plan.scratch_bytes + out_bytes
        assert impl.plan.scratch_bytes == SpyKernel.scratch_bytes(8192, H, TOPK, kv_format="bf16")
        assert not impl.session.frozen
        workspace.lock_workspace()  # vLLM, after capture
        impl._scratch()
        assert impl.session.frozen
    finally:
        workspace.reset_workspace_manager()


# -- kv_b_proj released under MQA-only ------------------------------------------------
@pytest.mark.parametrize("backend_cls", ["ours", "custom", "other"])
def test_kv_b_proj_released_only_for_this_backend(
    registered, cpu_session, monkeypatch, backend_cls
):
    monkeypatch.setattr(mla_attention, "set_default_quant_scales", lambda *a, **k: None)
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    layer = mla_layer("fp8-block")
    if backend_cls == "custom":  # the user opted in (VLLM_MLA_SPARSE_CUSTOM=1)
        assert registration.claim_custom() is None
    layer.attn_backend = {
        "ours": lambda: B12XMLASparseBackend,
        "custom": AttentionBackendEnum.CUSTOM.get_class,
        "other": lambda: FlashMLASparseBackend,  # control: same flags, not our capability
    }[backend_cls]()
    impl_mod._sessions[torch.device("cpu")] = PreparationSession("cpu", kernel=SpyKernel())
    layer.impl = make_impl(buffer=numpy_buffer()[0])
    layer.prefill_backend = None  # what MLAAttention.__init__ sets for this impl
    with torch.no_grad():
        post_load(layer, torch.bfloat16)
    released = layer.kv_b_proj.weight.numel() == 0
    assert released == (backend_cls != "other")
    assert layer.impl.plan is not None  # the impl hook ran first (preparation point)


# -- metadata builder -----------------------------------------------------------------
def builder_config(spec_tokens=None):
    spec = (
        None
        if spec_tokens is None
        else SimpleNamespace(
            num_speculative_tokens=spec_tokens,
            parallel_drafting=False,
            max_num_new_slots_for_drafting=0,  # vLLM 0.34 reads it (MTP drafts add none)
        )
    )
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(index_topk=TOPK)),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        speculative_config=spec,
    )


def test_builder_is_lean_and_reorders_decode_first():
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from vllm_mla.memory import AllocationTrace
    from vllm_mla.vllm.sparse.metadata import B12XMLASparseMetadataBuilder

    spec = SimpleNamespace(block_size=BLOCK)
    with AllocationTrace("cpu") as trace:
        builder = B12XMLASparseMetadataBuilder(spec, ["l0"], builder_config(), "cpu")
    # per schedulable token one int32 (its request) and top-k int32 (physical rows),
    # nothing else (no chunked-prefill or mask workspace)
    kept = sorted(a.size for a in trace.allocations() if not a.freed)
    assert kept == [256 * 4, 256 * builder.topk_tokens * 4]
    assert builder.reorder_batch_threshold == 1
    # batch: two decodes (1 token each) then one prefill of 3 tokens
    qsl = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=torch.tensor([9, 70, 3]),
        num_reqs=3,
        num_actual_tokens=5,
        max_query_len=3,
        max_seq_len=70,
        block_table_tensor=torch.zeros(3, 2, dtype=torch.int32),
        slot_mapping=torch.zeros(5, dtype=torch.int64),
    )
    md = builder.build(0, cam)  # on CPU the token -> request map is torch (vLLM's is Triton)
    assert md.req_id_per_token.tolist() == [0, 1, 2, 2, 2]
    assert md.physical_indices is builder.physical_indices_buffer
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 2, 1)
    assert md.prefill is None
    assert md.req_id_per_token.data_ptr() == builder.req_id_per_token_buffer.data_ptr()
    assert md.block_size == BLOCK and md.topk_tokens == TOPK


def test_builder_allocates_no_physical_rows_where_the_triton_kernel_maps_them(monkeypatch):
    """Where the plan is the Triton kernel (CUDA without b12x) the kernel maps logical rows
    itself: the [tokens, topk] physical buffer is not allocated (control: reference)."""
    from vllm_mla.memory import AllocationTrace
    from vllm_mla.vllm.sparse import metadata

    spec = SimpleNamespace(block_size=BLOCK)
    sizes = {}
    for impl in ("triton", "reference"):
        monkeypatch.setattr(metadata, "select_impl", lambda device, impl=impl: impl)
        with AllocationTrace("cpu") as trace:
            builder = metadata.B12XMLASparseMetadataBuilder(spec, ["l0"], builder_config(), "cpu")
        sizes[impl] = sorted(a.size for a in trace.allocations() if not a.freed)
        assert (builder.physical_indices_buffer is None) == (impl == "triton")
    assert sizes == {"triton": [256 * 4], "reference": [256 * 4, 256 * TOPK * 4]}


def test_builder_threshold_follows_speculative_decoding():
    from vllm_mla.vllm.sparse.metadata import B12XMLASparseMetadataBuilder

    spec = SimpleNamespace(block_size=BLOCK)
    builder = B12XMLASparseMetadataBuilder(spec, ["l0"], builder_config(3), "cpu")
    assert builder.reorder_batch_threshold == 4  # 1 + 3 drafts go decode-first too


def test_real_backend_releases_and_vllm_reload_regenerates_in_place(
    registered, cpu_session, monkeypatch
):
    """B12X_MLA_SPARSE itself (not a stand-in name): metadata recorded at init, load +
    post-load (sources released), vLLM's layerwise reload: pair addresses kept, new
    values, released again."""
    from test_mla_post_load import pair, upstream_pair

    monkeypatch.setattr(mla_attention, "set_default_quant_scales", lambda *a, **k: None)
    model = model_with("fp8-block")
    model.attn.attn_backend = B12XMLASparseBackend
    impl_mod._sessions[torch.device("cpu")] = PreparationSession("cpu", kernel=SpyKernel())
    model.attn.impl = make_impl(buffer=numpy_buffer()[0])
    model.attn.prefill_backend = None
    with torch.no_grad():
        post_load(model.attn, torch.bfloat16)
    kv_b = model.attn.kv_b_proj
    assert kv_b.weight.numel() == 0 and kv_b.weight_scale_inv.numel() == 0
    before = [t.data_ptr() for t in pair(model.attn)]
    reload_through_vllm(model, seed=3)
    assert [t.data_ptr() for t in pair(model.attn)] == before
    assert kv_b.weight.numel() == 0 and kv_b.weight_scale_inv.numel() == 0
    for ours, theirs in zip(pair(model.attn), upstream_pair("fp8-block", seed=3), strict=True):
        assert torch.equal(ours, theirs)


def test_a_decode_step_allocates_nothing_in_the_impl(cpu_session, monkeypatch):
    """Selection, the bound call, its launch and the output (a view of vLLM's workspace)
    allocate nothing per layer-step. The device kernels are stubbed at the Triton kernel
    objects (our launch Python runs). Triton plan: the kernel maps the logical top-k
    itself, so no conversion runs and no physical-row buffer is used. b12x plan (physical
    rows): on CUDA vLLM's Triton conversion writes into the builder's buffer (stood in
    here by a copy into ``out``); the CPU torch conversion is checked separately: its
    temporaries die inside the call."""
    from vllm.v1.worker import workspace

    from vllm_mla.memory import AllocationTrace
    from vllm_mla.ops.sparse_mla import triton_kernels

    convert_to_physical = impl_mod.convert_to_physical
    if not torch.accelerator.is_available():
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    launches, recording = [], []

    class Recorder:  # stands in for a @triton.jit kernel: kernel[grid](*args) records
        def __getitem__(self, grid):  # (only once recording: probes must die in prepare)
            return lambda *args, **kw: recording and launches.append((grid, args, kw))

    monkeypatch.setattr(triton_kernels, "_sparse_mla_split_kernel", Recorder())
    monkeypatch.setattr(triton_kernels, "_sparse_mla_combine_kernel", Recorder())
    from vllm_mla import envs

    monkeypatch.setattr(envs, "triton_interpret", lambda: True)  # impl='triton' on CPU tensors
    from vllm_mla.ops.sparse_mla import dispatch

    # b12x needs an SM12x GPU: resolved as asked, its runner absent -> our Triton launch
    monkeypatch.setattr(dispatch, "resolve", lambda impl, device: impl)
    tokens = 4
    buf = torch.full((8, TOPK), -1, dtype=torch.int32)
    buf[:tokens, :2] = torch.tensor([0, 65])
    impl = make_impl("bfloat16", indexer=SimpleNamespace(topk_indices_buffer=buf), buffer=buf)
    impl.process_weights_after_loading(torch.bfloat16)
    impl.plan = impl.session.plan(impl.caps, impl="triton")  # the GPU's implementation
    b12x_plan = impl.session.plan(impl.caps, impl="b12x")
    for plan in (impl.plan, b12x_plan):  # as post-load prepares the plan it picks
        impl.session.prepare(plan)
    cache = torch.zeros(4, BLOCK, 576, dtype=torch.bfloat16)
    metadata = SimpleNamespace(
        req_id_per_token=torch.zeros(8, dtype=torch.int32),
        block_table=torch.tensor([[2, 0]], dtype=torch.int32),
        block_size=BLOCK,
        num_decode_tokens=tokens,
        physical_indices=torch.empty(8, TOPK, dtype=torch.int32),
    )
    q_full = torch.randn(tokens, H, 576).bfloat16()
    q = (q_full[..., :512], q_full[..., 512:])
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        impl.reserve_workspace()  # the profile run
        workspace.lock_workspace()
        impl.forward_mqa(q, cache, metadata, layer=None)  # first call validates and binds
        recording.append(True)

        def no_conversion(*args, **kwargs):
            raise AssertionError("the Triton plan converted logical rows on the host side")

        monkeypatch.setattr(impl_mod, "convert_to_physical", no_conversion)
        with AllocationTrace("cpu") as trace:
            for _ in range(3):
                out, _ = impl.forward_mqa(q, cache, metadata, layer=None)
        assert trace.allocations() == []
        splits = [args for _, args, kw in launches if "LOGICAL" in kw]
        assert len(splits) == 3 and all(kw["LOGICAL"] for _, _, kw in launches if "LOGICAL" in kw)
        idx, req_id, table = splits[-1][3], splits[-1][10], splits[-1][11]  # kernel order
        assert idx.data_ptr() == buf.data_ptr() and idx.shape == (tokens, TOPK)  # logical
        assert req_id is metadata.req_id_per_token and table is metadata.block_table
        # the output is the workspace's buffer, not a new tensor
        _, out_buffer, lse_buffer = impl._workspace()
        assert lse_buffer is None  # no DCP: no lse reserved
        assert out.data_ptr() == out_buffer.data_ptr() and out.shape == (tokens, H, 512)

        # b12x plan (no runner on CPU: the Triton launch on physical rows)
        monkeypatch.setattr(impl_mod, "convert_to_physical", convert_to_physical)
        impl.plan, impl._call = b12x_plan, None
        impl.forward_mqa(q, cache, metadata, layer=None)
        assert metadata.physical_indices[0, :2].tolist() == [2 * 64, 1]  # written in place
        with AllocationTrace("cpu") as trace:
            impl.forward_mqa(q, cache, metadata, layer=None)
        assert trace.persistent_bytes() == 0  # CPU conversion: temporaries only
        expected = metadata.physical_indices[:tokens].clone()

        def cuda_contract(*args, out=None, shard=None):  # vLLM's: into out, else a new tensor
            return expected.clone() if out is None else out.copy_(expected)

        monkeypatch.setattr(impl_mod, "convert_to_physical", cuda_contract)
        with AllocationTrace("cpu") as trace:
            for _ in range(3):
                impl.forward_mqa(q, cache, metadata, layer=None)
        assert trace.allocations() == []
        logical_flags = [kw["LOGICAL"] for _, _, kw in launches if "LOGICAL" in kw]
        assert logical_flags[-3:] == [False] * 3  # physical rows
        # control: without the builder's buffer every step allocates its physical rows
        del metadata.physical_indices
        with AllocationTrace("cpu") as trace:
            impl.forward_mqa(q, cache, metadata, layer=None)
        assert [a.size for a in trace.allocations()] == [tokens * TOPK * 4]
    finally:
        workspace.reset_workspace_manager()


def record_launches(monkeypatch) -> list[dict]:
    """Our two Triton kernels stubbed (our launch Python runs): every launch is appended as
    {argument name: value} (runtime arguments in order, then the constexprs); impl='triton'
    is accepted for CPU tensors."""
    import inspect

    from vllm_mla import envs
    from vllm_mla.ops.sparse_mla import triton_kernels

    launches = []

    class Recorder:  # stands in for a @triton.jit kernel: kernel[grid](*args, **kw)
        def __init__(self, fn):
            self.names = list(inspect.signature(fn.fn).parameters)

        def __getitem__(self, grid):  # positional: the runtime arguments, in order
            named = lambda args: dict(zip(self.names, args, strict=False))  # noqa: E731
            return lambda *args, **kw: launches.append({**named(args), **kw})

    for name in ("_sparse_mla_split_kernel", "_sparse_mla_combine_kernel"):
        monkeypatch.setattr(triton_kernels, name, Recorder(getattr(triton_kernels, name)))
    monkeypatch.setattr(envs, "triton_interpret", lambda: True)
    return launches


def one_decode_token(impl, width: int) -> SimpleNamespace:
    """``impl``'s top-k buffer selecting logical rows 0 and 1 for one decode token of
    request 0 (page 0), and the metadata of that step."""
    logical = torch.full((8, width), -1, dtype=torch.int32)
    logical[0, :2] = torch.tensor([0, 1])
    impl.topk_indices_buffer = logical
    return SimpleNamespace(
        req_id_per_token=torch.zeros(1, dtype=torch.int32),
        block_table=torch.tensor([[0]], dtype=torch.int32),
        block_size=BLOCK,
        num_decode_tokens=1,
    )


def test_vllms_own_b12x_backend_is_not_ours(registered):
    """vLLM 0.34 registers a dense b12x paged backend as ``B12X``: our registration leaves
    it vLLM's, and nothing of ours (capabilities, sparse serving) keys on it."""
    from vllm_mla.formats import SPARSE_BACKEND
    from vllm_mla.vllm.capabilities import BackendCapabilities, capabilities_for

    if "B12X" not in AttentionBackendEnum.__members__:
        pytest.skip("this vLLM has no B12X backend (vLLM 0.33 and 0.34 have one)")
    assert AttentionBackendEnum["B12X"].get_path().startswith("vllm.v1.attention.backends.b12x.")
    assert capabilities_for("B12X") == BackendCapabilities("B12X")  # all off: upstream's
    assert AttentionBackendEnum[SPARSE_BACKEND].get_path().startswith("vllm_mla.")
