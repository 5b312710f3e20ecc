"""The lifecycle patch inside vLLM's real MLAAttention (CPU)."""

from __future__ import annotations

import pytest
import torch
import vllm_layers
from conftest import mla_layer, model_with, reload_through_vllm
from vllm.model_executor.layers.attention import mla_attention
from vllm_layers import post_load

from vllm_mla.vllm import telemetry
from vllm_mla.vllm.patches import vllm_minor
from vllm_mla.weights import ReleaseRefusedError

STOCK = mla_attention.MLAAttention.process_weights_after_loading


pytestmark = pytest.mark.usefixtures("no_default_quant_scales")


def pair(layer):
    return layer.W_UK_T, layer.W_UV


def upstream_pair(fmt, seed=0):
    layer = mla_layer(fmt, seed)
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16, STOCK)
    return pair(layer)


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
@pytest.mark.parametrize("backend", [None, "B12X_MLA_SPARSE"])
def test_pair_is_bit_identical_to_upstream(registered, fmt, backend):
    layer = mla_layer(fmt, backend=backend, dense_prefill=backend is None)
    with torch.no_grad():
        post_load(layer, torch.bfloat16)
    for ours, theirs in zip(pair(layer), upstream_pair(fmt), strict=True):
        assert isinstance(ours, torch.nn.Parameter)
        assert torch.equal(ours, theirs)
    if fmt == "fp8-block" or backend:  # the lifecycle owned it: contiguous pair
        assert all(t.is_contiguous() for t in pair(layer))


def test_bf16_kept_is_aliased_as_upstream_and_recorded(registered):
    telemetry.reset()
    layer = mla_layer("bf16")
    with torch.no_grad():
        post_load(layer, torch.bfloat16)
    # upstream's pair aliases the BF16 source: no copy at all, and so does ours
    assert layer.W_UK_T.untyped_storage().data_ptr() == (
        layer.kv_b_proj.weight.untyped_storage().data_ptr()
    )
    assert telemetry.snapshot()["post_load"] == [(layer.layer_name, "aliased")]


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_post_load_twice_with_new_weights_keeps_addresses(registered, fmt):
    layer = mla_layer(fmt)  # an upstream backend: the source stays and is rewritten in place
    with torch.no_grad():
        post_load(layer, torch.bfloat16)
        before = [t.data_ptr() for t in pair(layer)]
        fresh = mla_layer(fmt, seed=1).kv_b_proj
        for name, param in layer.kv_b_proj.named_parameters():
            param.copy_(getattr(fresh, name))
        post_load(layer, torch.bfloat16)
    assert [t.data_ptr() for t in pair(layer)] == before
    for ours, theirs in zip(pair(layer), upstream_pair(fmt, seed=1), strict=True):
        assert torch.equal(ours, theirs)


def test_release_only_with_the_capability(registered):
    kept = mla_layer("fp8-block", backend="FLASHMLA")
    released = mla_layer("fp8-block", backend="B12X_MLA_SPARSE", dense_prefill=False)
    with torch.no_grad():
        post_load(kept, torch.bfloat16)
        post_load(released, torch.bfloat16)
    assert kept.kv_b_proj.weight.numel() > 0
    assert released.kv_b_proj.weight.numel() == 0
    assert released.kv_b_proj.weight_scale_inv.numel() == 0
    assert hasattr(released.kv_b_proj.weight, "weight_loader")  # reloadable
    for ours, theirs in zip(pair(released), upstream_pair("fp8-block"), strict=True):
        assert torch.equal(ours, theirs)


def test_release_is_refused_with_a_dense_mha_prefill_backend(registered):
    layer = mla_layer("fp8-block", backend="B12X_MLA_SPARSE", dense_prefill=True)
    with pytest.raises(ReleaseRefusedError, match="MHA prefill"), torch.no_grad():
        post_load(layer, torch.bfloat16)
    assert layer.kv_b_proj.weight.numel() > 0


@pytest.mark.parametrize(
    "flag",
    ["is_amx_bmm_enabled", "is_aiter_triton_fp4_bmm_enabled", "is_aiter_triton_fp8_bmm_enabled"],
)
def test_own_bmm_paths_are_delegated_untouched(flag):
    from vllm_mla.vllm.patches.mla_post_load import make_process_weights_after_loading

    calls = []
    if vllm_minor() >= (0, 34):  # the stock signature of the installed vLLM

        def stock(layer):
            calls.append((layer, layer.act_dtype))
    else:

        def stock(layer, act_dtype):
            calls.append((layer, act_dtype))

    patched = make_process_weights_after_loading(stock)
    layer = mla_layer("fp8-block")
    setattr(layer, flag, True)
    telemetry.reset()
    vllm_layers.post_load(layer, torch.bfloat16, patched)
    assert calls == [(layer, torch.bfloat16)] and not hasattr(layer, "W_UK_T")
    assert telemetry.snapshot()["post_load"] == [(layer.layer_name, f"delegated: {flag}")]
    generic = mla_layer("fp8-block")
    with torch.no_grad():
        vllm_layers.post_load(generic, torch.bfloat16, patched)
    assert len(calls) == 1 and generic.W_UK_T.is_contiguous()


def test_vllm_layerwise_reload_keeps_addresses_and_takes_new_values(registered):
    """Drive vLLM's own layerwise reload: record, initialize, load, finalize."""
    model = model_with("fp8-block")
    with torch.no_grad():
        post_load(model.attn, torch.bfloat16)
    before = [t.data_ptr() for t in pair(model.attn)]
    reload_through_vllm(model, seed=2)
    assert [t.data_ptr() for t in pair(model.attn)] == before
    for ours, theirs in zip(pair(model.attn), upstream_pair("fp8-block", seed=2), strict=True):
        assert torch.equal(ours, theirs)


def test_reload_after_release_regenerates_in_place(registered):
    """Real order: metadata recorded at model init, load + post-load (release), reload."""
    model = model_with("fp8-block", backend="B12X_MLA_SPARSE", dense_prefill=False)
    with torch.no_grad():
        post_load(model.attn, torch.bfloat16)
    kv_b = model.attn.kv_b_proj
    assert kv_b.weight.numel() == 0
    before = [t.data_ptr() for t in pair(model.attn)]
    reload_through_vllm(model, seed=3)
    assert [t.data_ptr() for t in pair(model.attn)] == before
    assert kv_b.weight.numel() == 0 and kv_b.weight_scale_inv.numel() == 0  # released again
    for ours, theirs in zip(pair(model.attn), upstream_pair("fp8-block", seed=3), strict=True):
        assert torch.equal(ours, theirs)


class Int8RowwiseMethod:
    """A quant method the kv_b_proj matrix does not know: int8 rows with a per-row scale."""

    def apply(self, layer, x, bias=None):
        weight = layer.weight.float() * layer.row_scale[:, None]
        return (x.float() @ weight.T).to(x.dtype)


def int8_layer(seed=0, backend=None, dense_prefill=True):
    layer = mla_layer("bf16", seed=seed, backend=backend, dense_prefill=dense_prefill)
    kv_b = layer.kv_b_proj
    dense = kv_b.weight.detach().float()
    scale = dense.abs().amax(dim=1) / 127
    kv_b.weight = torch.nn.Parameter(
        (dense / scale[:, None]).round().to(torch.int8), requires_grad=False
    )
    kv_b.row_scale = torch.nn.Parameter(scale, requires_grad=False)
    kv_b.quant_method = Int8RowwiseMethod()
    return layer


def test_unknown_quant_method_is_delegated_untouched_and_named_once(registered, caplog):
    """Do no harm: a form the matrix does not know goes to upstream's post-load as is."""
    from vllm_mla.vllm.patches import mla_post_load

    mla_post_load._logged_unknown.clear()
    telemetry.reset()
    ours = [int8_layer(backend="B12X_MLA_SPARSE", dense_prefill=False) for _ in range(2)]
    theirs = int8_layer()
    with torch.no_grad(), caplog.at_level("WARNING", logger="vllm_mla"):
        for layer in ours:
            post_load(layer, torch.bfloat16)
        vllm_layers.post_load(theirs, torch.bfloat16, STOCK)
    for layer in ours:
        for a, b in zip(pair(layer), pair(theirs), strict=True):
            assert a.stride() == b.stride() and torch.equal(a, b)  # upstream's own views
        assert layer.kv_b_proj.weight.numel() > 0  # never released
    named = [r for r in caplog.records if "Int8RowwiseMethod" in r.getMessage()]
    assert len(named) == 1 and "delegated to upstream" in named[0].getMessage()
    actions = [a for _, a in telemetry.snapshot()["post_load"]]
    assert len(actions) == 2
    assert all(
        a.startswith("delegated: unknown kv_b_proj form (Int8RowwiseMethod") for a in actions
    )


class TwoRankGroup:
    """A DCP group of two ranks holding the same weights: all_gather stacks two copies."""

    def all_gather(self, tensor, dim=0):
        return torch.cat([tensor, tensor], dim=dim)


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_the_dcp_tail_gathers_what_upstreams_does(registered, monkeypatch, fmt):
    """Upstream's tail after the pair under DCP: the replicated-query W_UK_T (0.32-0.34)
    and, in vLLM 0.34, the W_UV its DCP v-up-projection combine reads: the same tensors as
    stock post-load gathers, from our pair."""
    from types import SimpleNamespace

    monkeypatch.setattr(mla_attention, "get_dcp_group", TwoRankGroup)
    made = {}
    for name, fn in (("stock", STOCK), ("ours", None)):
        layer = mla_layer(fmt)
        layer.dcp_q_replicate = True
        layer.q_pad_num_heads = None
        layer.dcp_manager = SimpleNamespace(v_up_proj_combine=object())
        with torch.no_grad():
            vllm_layers.post_load(layer, torch.bfloat16, fn)
        made[name] = layer
    stock, ours = made["stock"], made["ours"]
    names = ["W_UK_T_dcp_qrep"] + (["W_UV_dcp"] if vllm_minor() >= (0, 34) else [])
    for name in names:
        assert torch.equal(getattr(ours, name), getattr(stock, name)), name
    assert getattr(ours, "W_UV_dcp", None) is not None or vllm_minor() < (0, 34)
