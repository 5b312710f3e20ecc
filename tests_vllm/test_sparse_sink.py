"""HY-V4's learnable attention sink through B12X_MLA_SPARSE (vLLM 0.33, CPU).

HY-V4's own attention module (``HYV4MLAAttention``) binds this backend (``supports_sink``)
and hands its impl the sink Parameter (fp32 ``[heads]``, the local TP shard,
``nvidia/attention.py``); its weight loader (``load_attention_sink``) fills it after the
impl exists. Each forward passes it to the kernel call, where it joins every head's
softmax denominator: vLLM's FlashMLA documents the same sink as
``out *= exp(lse) / (exp(lse) + exp(sink))`` over the sink-free lse
(``vllm/third_party/flashmla/flash_mla_interface.py``, ``attn_sink``).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from test_sparse_backend import (  # noqa: F401
    BLOCK,
    TOPK,
    builder_config,
    cpu_session,
    one_decode_token,
    record_launches,
)
from test_sparse_refusals import current, hy_v4, hy_v4_attention  # noqa: F401

from vllm_mla.ops.sparse_mla import dispatch, logical_to_physical, sparse_mla_reference
from vllm_mla.vllm.sparse import impl as impl_mod

SINK = [1.5, -0.25, 3.0, float("-inf")]  # loaded values; -inf: a head without a sink


def kv_cache(blocks: int = 3) -> torch.Tensor:
    """bf16 records [blocks, 64, 576] on binary grids (exact in bf16)."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(-8, 9, (blocks, BLOCK, 576), generator=gen) / 8).bfloat16()


def test_hy_v4s_sink_reaches_the_kernel_and_changes_the_output(
    current,  # noqa: F811
    cpu_session,  # noqa: F811
    monkeypatch,
):
    """The real module, the sink loaded through vLLM's loader after the impl exists: the
    kernel call gets that Parameter (not a copy), and the output is the sink softmax of
    the reference, equal to vLLM's FlashMLA sink formula applied to the sink-free output."""
    attention = hy_v4_attention(current(hy_v4()))
    param = attention.learnable_sink_param
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, torch.tensor(SINK))  # vLLM 0.33's load_attention_sink (TP 1)
    else:  # vLLM 0.32: HYV4's load_weights copies the rank's heads into the Parameter
        with torch.no_grad():
            param[: len(SINK)].copy_(torch.tensor(SINK))
    impl = attention.mla_attn.impl
    seen = []
    real_run = dispatch.run

    def spy(*args, **kwargs):
        seen.append(kwargs.get("sink"))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(dispatch, "run", spy)
    logical = torch.full((8, TOPK), -1, dtype=torch.int32)
    logical[0, :4] = torch.tensor([0, 5, 70, 127])  # request 0 (pages 2, 0)
    logical[1, :3] = torch.tensor([3, 64, 1])  # request 1 (pages 1, 2)
    # token 2 selects nothing: out 0, lse = the sink
    impl.topk_indices_buffer = logical
    metadata = SimpleNamespace(
        req_id_per_token=torch.tensor([0, 1, 1], dtype=torch.int32),
        block_table=torch.tensor([[2, 0], [1, 2]], dtype=torch.int32),
        block_size=BLOCK,
        num_decode_tokens=3,
    )
    gen = torch.Generator().manual_seed(1)
    q = (torch.randint(-8, 9, (3, 4, 576), generator=gen) / 4).bfloat16()
    cache = kv_cache()
    out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, layer=None)

    assert lse is None and impl.plan.caps.sink  # no DCP: vLLM asks for no lse
    assert len(seen) == 1 and seen[0] is param  # the Parameter itself, as loaded
    physical = logical_to_physical(metadata.req_id_per_token, metadata.block_table, logical[:3], 64)
    ref, ref_lse = sparse_mla_reference(
        q, cache, physical, impl.scale, kv_format="bf16", sink=param.detach()
    )
    assert torch.equal(out, ref)  # the CPU plan is the reference itself
    plain, plain_lse = sparse_mla_reference(q, cache, physical, impl.scale, kv_format="bf16")
    # vLLM's FlashMLA sink (flash_mla_interface.py, attn_sink): out * e^lse / (e^lse + e^s)
    # over the sink-free lse; both sides are fp32 rounded once to bf16 (<= 2**-8 relative,
    # atol 2**-8 of max |v| = 1 for rows that nearly vanish)
    flashmla = plain.float() * torch.sigmoid(plain_lse - torch.tensor(SINK))[..., None]
    flashmla = torch.where(torch.isneginf(plain_lse)[..., None], 0.0, flashmla)
    torch.testing.assert_close(out.float(), flashmla, atol=2.0**-8, rtol=2.0**-7)
    assert (out[2] == 0).all() and torch.equal(ref_lse[2], param.detach())
    changed = (out.float() - plain.float()).abs().amax(-1)  # per (token, head)
    assert (changed[:2, :3] > 0).all()  # every head with a sink moves
    assert torch.equal(out[:, 3], plain[:, 3])  # the -inf head: no sink, to the bit


def test_the_triton_plan_launches_the_sink_variant_with_the_parameter(
    current,  # noqa: F811
    cpu_session,  # noqa: F811
    monkeypatch,
):
    """The GPU's plan (Triton: the kernel maps the logical top-k itself), its kernel
    objects stubbed (our launch Python runs): the split kernel gets ``SINK`` and the sink
    Parameter as ``sink_ptr``, the combine kernel (a split call) too."""
    launches = record_launches(monkeypatch)
    attention = hy_v4_attention(current(hy_v4()))
    impl = attention.mla_attn.impl
    impl._bind_plan(torch.device("cpu"))
    impl.plan = impl.session.plan(impl.caps, impl="triton")
    metadata = one_decode_token(impl, TOPK)
    q = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    impl.forward_mqa((q[..., :512], q[..., 512:]), kv_cache(1), metadata, layer=None)
    split, combine = launches  # one token, 4 heads, top-k 128: split-K, then combine
    assert split["SINK"] and split["LOGICAL"] and not split["DIRECT"]
    assert split["sink_ptr"] is attention.learnable_sink_param
    assert combine["SINK"] and combine["sink_ptr"] is attention.learnable_sink_param


def test_b12x_declines_the_sink_and_triton_serves(current, cpu_session, monkeypatch, caplog):  # noqa: F811
    """b12x has no sink input: a sink layer's plan is Triton's (it maps the logical top-k
    itself), and the metadata builder of a sink model allocates no physical rows."""
    from vllm_mla.ops.sparse_mla import api as sparse_api
    from vllm_mla.vllm.sparse import metadata

    assert impl_mod.serving_impl("b12x", 1, sink=True) == "triton"
    assert impl_mod.serving_impl("b12x", 1, sink=False) == "b12x"
    monkeypatch.setattr(sparse_api, "select_impl", lambda device: "b12x")
    with caplog.at_level(logging.INFO, logger="vllm_mla"):
        attention = hy_v4_attention(current(hy_v4()))
        attention.mla_attn.impl._bind_plan(torch.device("cpu"))
    plan = attention.mla_attn.impl.plan
    assert plan.impl == "triton" and plan.caps.sink
    assert "b12x declines the attention sink" in caplog.text
    monkeypatch.setattr(metadata, "select_impl", lambda device: "b12x")
    spec = SimpleNamespace(block_size=BLOCK)
    for sink, allocated in ((False, True), (True, False)):
        config = builder_config()
        config.model_config.hf_text_config.learnable_sink = sink
        builder = metadata.B12XMLASparseMetadataBuilder(spec, ["l0"], config, "cpu")
        assert (builder.physical_indices_buffer is not None) == allocated


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16"])
def test_the_sink_is_prepared_and_a_frozen_call_compiles_nothing(
    current,  # noqa: F811
    cpu_session,  # noqa: F811
    kv_cache_dtype,
):
    """process_weights_after_loading prepares the plan (its caps declare the sink); after
    freeze the sink call runs, and a call without it is refused, naming the sink."""
    attention = hy_v4_attention(current(hy_v4()))
    impl = attention.mla_attn.impl
    impl.process_weights_after_loading(torch.bfloat16)
    assert impl.session.is_prepared(impl.plan, impl.caps.max_tokens) and impl.caps.sink
    impl.session.freeze()
    metadata = one_decode_token(impl, TOPK)
    q = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    cache = kv_cache(1)
    out, _ = impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, layer=None)
    assert out.shape == (1, 4, 512)
    impl._call_sinks = None  # what the kernel calls pass
    with pytest.raises(ValueError, match="sink: the plan declares sink=True, got None"):
        impl.forward_mqa((q[..., :512], q[..., 512:]), cache, metadata, layer=None)


# -- vLLM CPU: HY-V4's indexer query quantization -----------------------------------------
def test_hy_v4s_indexer_query_quantization_runs_on_cpu(registered, monkeypatch):
    """HY-V4's indexer quantizes its query through its own import of
    ``per_token_group_quant_fp8`` (``nvidia/attention.py``), which the ``deepseek_v2``
    patch does not reach: patched under HY-V4's name too (``cpu_indexer_query_quant_hy_v4``),
    the same rule as ``quantize_rows``; control: without the plugin it needs Triton."""
    from vllm.models.hy_v4.nvidia import attention
    from vllm.triton_utils import HAS_TRITON

    from vllm_mla.ops import sparse_indexer
    from vllm_mla.vllm import patches, plugin

    assert hasattr(attention.per_token_group_quant_fp8, patches.MARK)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 256, generator=gen)
    values, scales = attention.per_token_group_quant_fp8(
        q, 128, column_major_scales=False, use_ue8m0=True
    )  # HY-V4's call (nvidia/attention.py, Indexer.forward)
    want_v, want_s = sparse_indexer.quantize_rows(q.view(5, 2, 128), ue8m0=True, floor=1e-10)
    assert torch.equal(scales, want_s) and torch.equal(values.view(5, 2, 128), want_v)
    monkeypatch.setenv("VLLM_MLA_FEATURES", "lifecycle")  # control: sparse-cpu off
    plugin.reset()
    plugin.register()
    assert not hasattr(attention.per_token_group_quant_fp8, patches.MARK)
    if not HAS_TRITON:
        with pytest.raises((AttributeError, TypeError, RuntimeError)):
            attention.per_token_group_quant_fp8(q, 128, column_major_scales=False, use_ue8m0=True)
