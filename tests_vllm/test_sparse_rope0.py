"""GLM-5.3-Flash's latent-512 MLA without RoPE through B12X_MLA_SPARSE (vLLM 0.33, CPU).

vLLM's ``MLAAttention`` at head_size 512 (kv_lora_rank 512, qk_rope_head_dim 0: ``k_pe`` is
``[T, 1, 0]``, the MQA query ``(q_nope [T, H, 512], q_pe [T, H, 0])``) binds this backend;
its KV cache is fp8_ds_mla records of 656 bytes (vLLM sizes the page by the format,
``mla_attention.py`` ``state_content_bytes``; the rope slot is whatever the page held) or
bf16 records 512 wide; its shared top-k buffer is ``round_up(index_topk + index_kpool - 1,
128)`` wide (glm5next ``get_sparse_topk_buffer_width``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_sparse_backend import (  # noqa: F401
    BLOCK,
    builder_config,
    cpu_session,
    one_decode_token,
    record_launches,
    validate,
)
from test_sparse_refusals import current, glm_5_3_flash, mla_attention  # noqa: F401

from vllm_mla.formats import LATENT
from vllm_mla.ops.sparse_mla import logical_to_physical, pack_rows, sparse_mla_reference
from vllm_mla.ops.sparse_mla.formats import FP8_ROPE_OFFSET, record_width
from vllm_mla.vllm.sparse.impl import B12XMLASparseImpl
from vllm_mla.vllm.sparse.served import topk_buffer_width

H = 4


def flash_layer(current, monkeypatch, kv_cache_dtype="bfloat16"):  # noqa: F811
    """vLLM's MLAAttention at GLM-5.3-Flash's geometry, with the model's own top-k buffer
    width (2176 = round_up(2048 + 16 - 1, 128))."""
    config = current(glm_5_3_flash())
    monkeypatch.setattr(config.cache_config, "cache_dtype", kv_cache_dtype)
    width = topk_buffer_width(config.model_config.hf_text_config)
    layer = mla_attention(
        num_heads=H,
        qk_rope_head_dim=0,
        topk_indices_buffer=torch.full((8, width), -1, dtype=torch.int32),
    )
    return layer, width


def test_the_model_and_its_layer_are_served(current, monkeypatch):  # noqa: F811
    layer, width = flash_layer(current, monkeypatch)
    impl = layer.impl
    assert isinstance(impl, B12XMLASparseImpl) and layer.head_size == LATENT
    assert width == 2176  # glm5next: round_up(index_topk 2048 + index_kpool 16 - 1, 128)
    assert impl.caps.rope == 0 and impl.caps.topk == width
    assert validate(head=LATENT) == [] and validate(head=LATENT, kv="bfloat16") == []


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "bfloat16"])
def test_forward_through_vllms_layer_matches_a_float64_hand_computation(
    current,  # noqa: F811
    cpu_session,  # noqa: F811
    monkeypatch,
    kv_cache_dtype,
):
    """The layer's impl writes the step's latents with a 0-wide k_pe (vLLM's shapes) and
    attends over the logical top-k: scores are q_nope . kv_c alone. The fp8 rope slots,
    poisoned afterwards as vLLM's writer may leave them, change nothing."""
    layer, width = flash_layer(current, monkeypatch, kv_cache_dtype)
    impl = layer.impl
    fmt = impl.kv_format
    blocks, rows = 3, 3 * BLOCK
    elems, dtype = record_width(fmt, 0)
    cache = torch.zeros(blocks, BLOCK, elems, dtype=dtype)  # vLLM's page: [.., 656 | 512]
    gen = torch.Generator().manual_seed(0)
    # binary grid, a 7/8 per 128-group (power-of-two fp8 scales): exact in bf16 and e4m3
    kv_c = torch.randint(-7, 8, (rows, LATENT), generator=gen) / 8
    kv_c[:, ::128] = 7 / 8
    slots = torch.arange(rows)
    impl.do_kv_cache_update(kv_c, kv_c.new_empty(rows, 1, 0), cache, slots, kv_cache_dtype, None)
    if fmt == "fp8_ds_mla":
        cache[..., FP8_ROPE_OFFSET:] = 0xFF  # NaN bf16: the slot must never be read
    logical = torch.full((8, width), -1, dtype=torch.int32)
    logical[0, :4] = torch.tensor([0, 5, 70, 127])
    logical[1, :3] = torch.tensor([3, 64, 1])
    impl.topk_indices_buffer = logical
    metadata = SimpleNamespace(
        req_id_per_token=torch.tensor([0, 1, 1], dtype=torch.int32),
        block_table=torch.tensor([[2, 0], [1, 2]], dtype=torch.int32),
        block_size=BLOCK,
        num_decode_tokens=3,
    )
    q = (torch.randint(-8, 9, (3, H, LATENT), generator=gen) / 4).bfloat16()
    out, lse = impl.forward_mqa((q, q.new_empty(3, H, 0)), cache, metadata, layer=None)
    assert lse is None and out.shape == (3, H, LATENT)
    physical = logical_to_physical(metadata.req_id_per_token, metadata.block_table, logical[:3], 64)
    ref, _ = sparse_mla_reference(q, cache, physical, impl.scale, kv_format=fmt)
    assert torch.equal(out, ref)  # the CPU plan is the reference itself
    for t in range(3):
        chosen = physical[t][physical[t] >= 0].long()
        if chosen.numel() == 0:
            assert (out[t] == 0).all()
            continue
        keys = kv_c[chosen].double()
        s = q[t].double() @ keys.T * impl.scale
        want = torch.softmax(s, -1) @ keys
        # out is fp32 rounded once to bf16 (<= 2**-9 relative, rtol 2**-8 leaves 2x); the
        # fp32 softmax of <= 4 exact dots is within ~1e-6 of float64 (atol 1e-5 leaves 10x)
        torch.testing.assert_close(out[t].double(), want, rtol=2.0**-8, atol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_ds_mla", "bfloat16"])
def test_the_writer_stores_what_the_reference_rounds_for_any_latent(
    current,  # noqa: F811
    monkeypatch,
    kv_cache_dtype,
):
    """Random bf16 latents (off any grid, as a served model's are), written by the layer's
    impl at rope 0 to shuffled slots, are byte for byte ``pack_rows`` of the same values at
    those slots. On CPU the impl packs with that same function (the one the end-to-end
    references round through), so this pins the writer's plumbing: slots, the 0-wide
    k_pe, bf16 input; the packer's own rule is tests/test_sparse_mla_kv_format.py's. On CUDA
    vLLM's concat_and_cache_mla writes (not run here)."""
    layer, _ = flash_layer(current, monkeypatch, kv_cache_dtype)
    fmt = layer.impl.kv_format
    rows = 2 * BLOCK
    elems, dtype = record_width(fmt, 0)
    cache = torch.zeros(2, BLOCK, elems, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    kv_c = torch.randn(rows, LATENT, generator=gen) * torch.logspace(-3, 2, rows)[:, None]
    kv_c = kv_c.bfloat16()
    slots = torch.randperm(rows, generator=gen)
    layer.impl.do_kv_cache_update(
        kv_c, kv_c.new_empty(rows, 1, 0), cache, slots, kv_cache_dtype, None
    )
    want = pack_rows(kv_c.float(), torch.empty(rows, 0), fmt)
    got = cache.view(rows, elems)[slots]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_the_triton_plan_launches_rope_0(current, cpu_session, monkeypatch):  # noqa: F811
    """The GPU's plan (Triton, logical top-k mapped in the kernel), kernel objects stubbed:
    the split kernel gets ``ROPE=0`` and never q_pe's (empty) storage."""
    launches = record_launches(monkeypatch)
    layer, width = flash_layer(current, monkeypatch)
    impl = layer.impl
    impl._bind_plan(torch.device("cpu"))
    impl.plan = impl.session.plan(impl.caps, impl="triton")
    metadata = one_decode_token(impl, width)
    q = torch.zeros(1, H, LATENT, dtype=torch.bfloat16)
    cache = torch.zeros(1, BLOCK, LATENT, dtype=torch.bfloat16)
    impl.forward_mqa((q, q.new_empty(1, H, 0)), cache, metadata, layer=None)
    split = launches[0]
    assert split["ROPE"] == 0 and split["LOGICAL"] and split["K"] == width
    assert split["qp_ptr"] is split["qn_ptr"]  # q_nope stands in for the empty q_pe


def test_the_builder_sizes_its_topk_buffers_from_the_models_buffer_width(monkeypatch):
    """A kpool model's top-k buffer is wider than index_topk: the builder's physical-row
    buffer and topk_tokens follow the model's width (vLLM glm5next's), not index_topk."""
    from vllm_mla.vllm.sparse import metadata

    monkeypatch.setattr(metadata, "select_impl", lambda device: "reference")
    config = builder_config()
    hf = SimpleNamespace(index_topk=2048, index_kpool=16)
    config.model_config = SimpleNamespace(hf_text_config=hf)
    builder = metadata.B12XMLASparseMetadataBuilder(
        SimpleNamespace(block_size=BLOCK), ["l0"], config, "cpu"
    )
    assert builder.topk_tokens == 2176
    assert builder.physical_indices_buffer.shape == (256, 2176)
    assert topk_buffer_width(SimpleNamespace(index_topk=2048)) == 2048  # no kpool: index_topk
    assert topk_buffer_width(SimpleNamespace(index_topk=100, index_kpool=1)) == 128


def test_b12x_plans_give_way_to_triton_without_rope(monkeypatch):
    """b12x's GLM_NSA records carry a 64-wide RoPE: where the kernel would choose b12x, a
    rope-0 model's plans (and so its builder: no physical-row buffer) are Triton's."""
    from vllm_mla.vllm.sparse import impl as impl_mod
    from vllm_mla.vllm.sparse import metadata

    assert impl_mod.serving_impl("b12x", rope=0) == "triton"
    assert impl_mod.serving_impl("b12x") == "b12x"  # control: rope 64
    monkeypatch.setattr(metadata, "select_impl", lambda device: "b12x")
    config = builder_config()
    for rope, physical in ((0, False), (64, True)):
        hf = SimpleNamespace(index_topk=2048, index_kpool=16, qk_rope_head_dim=rope)
        config.model_config = SimpleNamespace(hf_text_config=hf)
        builder = metadata.B12XMLASparseMetadataBuilder(
            SimpleNamespace(block_size=BLOCK), ["l0"], config, "cpu"
        )
        assert (builder.physical_indices_buffer is not None) == physical
