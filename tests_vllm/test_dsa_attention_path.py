"""vLLM 0.33's CUDA path for DSA models (``DeepseekV32Attention``) with our impl, on CPU.

On CUDA, DeepSeek-V3.2 and GLM-5 are served by ``vllm.models.deepseek_v32``: its
``forward`` never reaches ``MLAAttention.forward_impl``; the eager
``_sparse_indexer_and_attn`` calls ``impl.prepare_for_batch``, ``impl.forward_mqa`` and
``torch.bmm(x, W_UV)``. Here that very method runs (vLLM's code, our impl) on a CPU
cache with a filled top-k buffer, against the reference; and every ``impl.<member>`` the
path uses exists on ours.
"""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
import torch
from test_sparse_backend import TOPK, H, make_impl
from test_sparse_backend import cpu_session as cpu_session  # the fixture, re-exported
from torch import nn
from vllm_layers import vllm_config

from vllm_mla.ops.sparse_mla import pack_rows, sparse_mla_reference
from vllm_mla.vllm.sparse import impl as impl_mod
from vllm_mla.vllm.sparse.impl import B12XMLASparseImpl

LAYER = "model.layers.0.self_attn.attn"
V_DIM, BLOCK = 128, 64
FORMATS = {"fp8_ds_mla": "fp8_ds_mla", "bfloat16": "bf16"}


def dsa_module():
    return pytest.importorskip("vllm.models.deepseek_v32.attention")


def impl_members_used() -> set[str]:
    """Every ``self.impl.<name>`` in vLLM's DSA attention module."""
    source = inspect.getsource(dsa_module())
    return set(re.findall(r"self\.impl\.([A-Za-z_]\w*)", source))


def test_every_impl_member_the_dsa_path_uses_exists_on_ours():
    used = impl_members_used()
    assert {"forward_mqa", "prepare_for_batch", "record_logical_topk_ready"} <= used
    impl = make_impl(buffer=torch.full((8, TOPK), -1, dtype=torch.int32))
    missing = sorted(name for name in used if not hasattr(impl, name))
    assert missing == [], f"vLLM's DSA path uses impl members ours lacks: {missing}"
    assert "do_kv_cache_update" in used
    assert list(inspect.signature(B12XMLASparseImpl.do_kv_cache_update).parameters)[-1] == (
        "skip_scale"
    )  # the 7-argument call of the PCP path


def dsa_layer(impl, cache, w_uv):
    """A DeepseekV32Attention holding only what ``_sparse_indexer_and_attn`` reads."""
    cls = dsa_module().DeepseekV32Attention
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    layer.indexer, layer.skip_topk, layer.use_pcp = None, True, False
    layer.impl, layer.layer_name, layer.kv_cache = impl, LAYER, cache
    layer.hisparse_cache, layer.prefill_backend, layer.dcp_manager = None, None, None
    layer._fp8_kv_needs_view, layer._fp8_query = False, False
    layer.num_local_heads, layer.kv_lora_rank, layer.v_head_dim = H, 512, V_DIM
    layer.W_UV = nn.Parameter(w_uv, requires_grad=False)
    return layer


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_sparse_indexer_and_attn_serves_through_our_impl(cpu_session, kv_cache_dtype):
    from vllm.forward_context import set_forward_context

    gen = torch.Generator().manual_seed(3)
    kv_format = FORMATS[kv_cache_dtype]
    blocks, tokens = 4, 3
    kv_c = torch.randn(blocks * BLOCK, 512, generator=gen)
    k_pe = torch.randn(blocks * BLOCK, 64, generator=gen)
    records = pack_rows(kv_c, k_pe, kv_format)
    cache = records.view(blocks, BLOCK, -1)
    buf = torch.full((8, TOPK), -1, dtype=torch.int32)
    buf[0, :3] = torch.tensor([0, 65, 3])
    buf[1, :2] = torch.tensor([63, 64])
    buf[2, :4] = torch.tensor([1, 2, 3, 70])
    impl = make_impl(kv_cache_dtype, buffer=buf)
    w_uv = torch.randn(H, 512, V_DIM, generator=gen).bfloat16()
    layer = dsa_layer(impl, cache, w_uv)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    req = torch.tensor([1, 0, 1], dtype=torch.int32)
    metadata = SimpleNamespace(
        req_id_per_token=req,
        block_table=table,
        block_size=BLOCK,
        num_decode_tokens=tokens,
        num_actual_tokens=tokens,
        prefill=None,
    )
    config = vllm_config()
    config.compilation_config.static_forward_context[LAYER] = layer
    q_full = torch.randn(tokens, H, 576, generator=gen).bfloat16()
    ql_nope, q_pe = q_full[..., :512], q_full[..., 512:]
    output = torch.full((tokens, H * V_DIM), float("nan"), dtype=torch.bfloat16)
    try:
        with set_forward_context({LAYER: metadata}, config, slot_mapping={LAYER: None}):
            layer._sparse_indexer_and_attn(
                None, None, None, q_pe, None, None, None, None, None, ql_nope, q_pe, output
            )
    finally:
        config.compilation_config.static_forward_context.pop(LAYER)
    physical = impl_mod.convert_to_physical(req, table, buf[:tokens], BLOCK)
    latent, _ = sparse_mla_reference(
        (ql_nope, q_pe), cache, physical, impl.scale, kv_format=kv_format
    )
    expected = torch.bmm(latent.transpose(0, 1), w_uv).transpose(0, 1).reshape(tokens, -1)
    # On CPU the impl runs sparse_mla_reference on these inputs (the same bf16 latent); the
    # W_UV bmm may sum in another order: 512 terms, <= 512 * 2**-23 * sum|l w| (<= 2e-2 for
    # these N(0, 1) weights; atol 3e-2), and each side rounds to bf16 (2 * 2**-8; rtol 3e-2)
    torch.testing.assert_close(output.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_the_profile_run_of_the_dsa_path_reserves_our_scratch(cpu_session, monkeypatch):
    """``DeepseekV32Attention.forward`` calls ``prepare_for_batch(None)`` in the profile run
    and never ``forward_impl``: that call must reserve the backend's scratch."""
    impl = make_impl("bfloat16", buffer=torch.full((8, TOPK), -1, dtype=torch.int32))
    reserved = []
    monkeypatch.setattr(impl, "reserve_workspace", lambda: reserved.append(True))
    impl.prepare_for_batch(None)
    assert reserved == [True]
    impl.prepare_for_batch(SimpleNamespace())  # a real batch: nothing to reserve
    assert reserved == [True]
    source = inspect.getsource(dsa_module().DeepseekV32Attention.forward)
    assert "self.impl.prepare_for_batch(layer_attn_metadata)" in source
