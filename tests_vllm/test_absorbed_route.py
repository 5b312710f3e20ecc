"""The absorbed-weight route on vLLM's real layers: direct mode on every MXFP8 kernel variant
vLLM builds, safe mode on the BF16 pair, vLLM's own reload machinery, and the DSA
absorption compiled by dynamo (fullgraph).

Every variant is a real ColumnParallelLinear with vLLM's quant config and the kernel it
selects (CUDA-only kernels with ``vllm_layers`` stand-ins for their GPU calls); the MLA
layer is vLLM's MLAAttention, and its post-load is the plugin's patch.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import vllm_layers
from vllm.model_executor.layers.attention import mla_attention
from vllm_layers import HEADS, LATENT, NOPE, V_DIM, build_kv_b_proj, installed, mla_layer, stand_ins

from vllm_mla.memory import Ledger
from vllm_mla.ops import absorbed_matmul as ab
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.vllm import telemetry
from vllm_mla.weights.direct import DIRECT_DECODES, DirectModeError
from vllm_mla.weights.forms import form
from vllm_mla.weights.sources import module_tensors

STOCK = mla_attention.MLAAttention.process_weights_after_loading
SPARSE = "B12X_MLA_SPARSE"
VARIANTS = installed()
DIRECT = [v for v in VARIANTS if form(v.form).decode in DIRECT_DECODES]
NOT_DIRECT = [v for v in VARIANTS if form(v.form).decode not in DIRECT_DECODES]
PAIR = ("W_UK_T", "W_UV")


pytestmark = pytest.mark.usefixtures("no_default_quant_scales")


def upstream_pair(variant, seed=0):
    layer = mla_layer(build_kv_b_proj(variant, seed))
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16, STOCK)
    return {n: getattr(layer, n) for n in PAIR}


def post_load(layer, dtype=torch.bfloat16):
    telemetry.reset()
    with torch.no_grad():
        vllm_layers.post_load(layer, dtype)
    return [action for _, action in telemetry.snapshot()["post_load"]]


def v_up(layer, x):
    """vLLM's own ``_v_up_proj`` (patched or not) on ``x [T, H, L]``."""
    out = torch.empty(x.shape[0], HEADS * V_DIM, dtype=x.dtype)
    layer._v_up_proj(x, out)
    return out


@pytest.mark.parametrize("variant", DIRECT, ids=[v.id for v in DIRECT])
@pytest.mark.parametrize("backend", [None, SPARSE])
def test_direct_views_serve_every_mxfp8_variant(registered, monkeypatch, variant, backend):
    monkeypatch.setenv("VLLM_MLA_ABSORBED", "direct")
    with stand_ins(monkeypatch, variant):
        layer = mla_layer(build_kv_b_proj(variant), backend, dense_prefill=backend is None)
        sizes = {n: t.numel() for n, t in module_tensors(layer.kv_b_proj).items()}
        assert post_load(layer) == ["direct"]
        want = upstream_pair(variant)
    for n in PAIR:
        got = getattr(layer, n)
        assert isinstance(got, AbsorbedWeight) and got.kind == "mxfp8"
        assert torch.equal(got.dense_values(), want[n])
    row = Ledger().add_layer(layer)
    assert row["absorbed"] > 0
    if backend is None:  # kv_b_proj stays whole and callable for the dense MHA prefill
        assert {n: t.numel() for n, t in module_tensors(layer.kv_b_proj).items()} == sizes
    # both absorptions through vLLM's own code: the V up-projection method and the
    # query bmm exactly as forward_impl writes it
    x = torch.randn(3, HEADS, LATENT).bfloat16()
    ab.reset_calls()
    got = v_up(layer, x)
    q = torch.randn(3, HEADS, NOPE + 64).bfloat16()[..., :NOPE].transpose(0, 1)
    ql = q.new_empty((3, HEADS, LATENT))
    torch.bmm(q, layer.W_UK_T, out=ql.transpose(0, 1))
    assert {k.split(":")[1] for k in ab.calls()} == {"W_UV", "W_UK_T"}
    ref_v = torch.bmm(x.transpose(0, 1).float(), want["W_UV"].float()).transpose(0, 1)
    # got is rounded to bf16 once (<= 2**-8 relative; rtol 2e-2 leaves 5x); the fp32 sums of
    # 512 terms (x ~ N(0, 1), W ~ 0.05 N(0, 1)) differ by <= 512 * 2**-23 * sum|x w| ~ 1e-3
    # (atol 2e-3 leaves 2x, for results that cancel far below their terms)
    torch.testing.assert_close(got.view(3, HEADS, V_DIM).float(), ref_v, rtol=2e-2, atol=2e-3)
    ref_q = torch.bmm(q.float(), want["W_UK_T"].float()).transpose(0, 1)
    torch.testing.assert_close(ql.float(), ref_q, rtol=2e-2, atol=2e-3)  # the same (96 terms)


SWIZZLED = [v for v in DIRECT if form(v.form).decode == "mxfp8-swizzled"]


@pytest.mark.parametrize("variant", SWIZZLED, ids=[v.id for v in SWIZZLED])
def test_a_post_load_after_the_swizzled_scales_were_released_stays_ours(
    registered, monkeypatch, variant
):
    """With the swizzled scales released kv_b_proj matches no row of the matrix any more;
    the layer is still ours (a no-op), never handed to upstream's post-load."""
    monkeypatch.setenv("VLLM_MLA_ABSORBED", "direct")
    with stand_ins(monkeypatch, variant):
        layer = mla_layer(build_kv_b_proj(variant), SPARSE, dense_prefill=False)
        assert post_load(layer) == ["direct"]
        assert module_tensors(layer.kv_b_proj)["weight_scale"].numel() == 0
        assert post_load(layer) == ["noop"]
        want = upstream_pair(variant)
    for n in PAIR:
        assert torch.equal(getattr(layer, n).dense_values(), want[n])


@pytest.mark.parametrize("variant", NOT_DIRECT, ids=[v.id for v in NOT_DIRECT])
def test_direct_is_refused_at_start_up_for_forms_without_a_pack(registered, monkeypatch, variant):
    monkeypatch.setenv("VLLM_MLA_ABSORBED", "direct")
    with stand_ins(monkeypatch, variant):
        layer = mla_layer(build_kv_b_proj(variant))
        before = vllm_layers.snapshot(layer)
        with pytest.raises(DirectModeError, match=f"this one is form '{variant.form}'"):
            post_load(layer)
    assert vllm_layers.same_as(layer, before) == []


def test_direct_is_refused_for_layers_that_own_their_bmm(registered, monkeypatch):
    monkeypatch.setenv("VLLM_MLA_ABSORBED", "direct")
    variant = DIRECT[0]
    with stand_ins(monkeypatch, variant):
        layer = mla_layer(build_kv_b_proj(variant))
    layer.is_amx_bmm_enabled = True
    with pytest.raises(DirectModeError, match="is_amx_bmm_enabled"):
        post_load(layer)


@pytest.mark.parametrize("mode", ["auto", "bf16"])
def test_auto_and_bf16_keep_the_pair(registered, monkeypatch, mode):
    monkeypatch.setenv("VLLM_MLA_ABSORBED", mode)
    variant = DIRECT[0]
    with stand_ins(monkeypatch, variant):
        layer = mla_layer(build_kv_b_proj(variant), SPARSE, dense_prefill=False)
        assert post_load(layer) == ["materialized"]
    assert not isinstance(layer.W_UK_T, AbsorbedWeight)


def _inner_pointers(layer):
    return [t.data_ptr() for n in PAIR for t in getattr(layer, n).inner_tensors()]


@pytest.mark.parametrize("variant", DIRECT, ids=[v.id for v in DIRECT])
def test_vllm_layerwise_reload_refreshes_the_views_in_place(registered, monkeypatch, variant):
    monkeypatch.setenv("VLLM_MLA_ABSORBED", "direct")
    with stand_ins(monkeypatch, variant):
        model = vllm_layers.build_model(variant, 0, backend=SPARSE, dense_prefill=False)
        post_load(model.attn)
        before = _inner_pointers(model.attn)
        vllm_layers.reload_through_vllm(model, variant, seed=1)
        want = upstream_pair(variant, seed=1)
    assert _inner_pointers(model.attn) == before
    for n in PAIR:
        assert torch.equal(getattr(model.attn, n).dense_values(), want[n])


@pytest.mark.parametrize("kind", ["safe", "direct"])
def test_vllm_copy_and_restore_keeps_routed_weights(registered, monkeypatch, kind):
    """The attention-layer reload path with checkpoint scales: every kept parameter
    (W_UK_T and W_UV included) gets ``param.data.copy_(current)`` and is placed back."""
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    monkeypatch.setenv("VLLM_MLA_ABSORBED", "direct" if kind == "direct" else "bf16")
    monkeypatch.setenv("VLLM_MLA_SAFE_BMM", "always")
    variant = DIRECT[0]
    with stand_ins(monkeypatch, variant):
        layer = mla_layer(build_kv_b_proj(variant))
        post_load(layer)
    kept = {n: getattr(layer, n) for n in PAIR}
    values = {n: w.dense_values().clone() for n, w in kept.items()}
    info = layerwise.get_layerwise_info(layer)
    info.kernel_tensors = get_layer_params_buffers(layer)
    info.kernel_non_persistent_buffers = set()
    layerwise._copy_and_restore_kernel_tensors(layer, info)
    for n in PAIR:
        assert getattr(layer, n) is kept[n] and isinstance(kept[n], AbsorbedWeight)
        assert torch.equal(kept[n].dense_values(), values[n])


def test_safe_mode_routes_every_bmm_of_the_pair(registered, monkeypatch):
    monkeypatch.setenv("VLLM_MLA_SAFE_BMM", "always")
    variant = DIRECT[0]
    with stand_ins(monkeypatch, variant):
        layer = mla_layer(build_kv_b_proj(variant))
        assert post_load(layer) == ["materialized", "safe route bound"]
        want = upstream_pair(variant)
    for n in PAIR:
        w = getattr(layer, n)
        assert isinstance(w, AbsorbedWeight) and w.kind == "dense"
        assert torch.equal(w.dense_values(), want[n])
    x = torch.randn(2, HEADS, LATENT).bfloat16()
    ab.reset_calls()
    telemetry.reset()
    got = v_up(layer, x)
    assert telemetry.snapshot()["query"] == {"v_up_proj:routed": 1}
    assert ab.calls() == {"safe:W_UV": 1}
    layer.W_UV = torch.nn.Parameter(want["W_UV"], requires_grad=False)  # stock, unrouted
    layer.__dict__.pop("_vllm_mla_safe_v_up", None)
    monkeypatch.setenv("VLLM_MLA_SAFE_BMM", "never")
    assert torch.equal(got, v_up(layer, x))  # the same bf16 bmm semantics


def test_safe_mode_off_leaves_the_pair_plain(registered, monkeypatch):
    monkeypatch.setenv("VLLM_MLA_SAFE_BMM", "never")
    variant = DIRECT[0]
    with stand_ins(monkeypatch, variant):
        layer = mla_layer(build_kv_b_proj(variant))
        assert post_load(layer) == ["materialized"]
    assert not isinstance(layer.W_UK_T, AbsorbedWeight)


def test_the_dsa_forward_does_the_absorption_this_test_compiles():
    from vllm.models.deepseek_v32 import attention

    source = inspect.getsource(attention.DeepseekV32Attention.forward)
    assert "torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)" in source
    assert "q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)" in source
    eager = inspect.getsource(attention.DeepseekV32Attention._sparse_indexer_and_attn)
    assert "torch.bmm(x, self.W_UV, out=out)" in eager


@pytest.mark.parametrize("kind", ["safe", "direct"])
def test_dynamo_compiles_the_dsa_absorption_fullgraph(registered, monkeypatch, kind):
    """DeepseekV32Attention.forward's absorption (its q_b_proj, split and bmm) compiled with
    fullgraph=True: the routed W_UK_T is one custom-op node and computes the same values."""
    monkeypatch.setenv("VLLM_MLA_ABSORBED", "direct" if kind == "direct" else "bf16")
    monkeypatch.setenv("VLLM_MLA_SAFE_BMM", "always")
    variant = DIRECT[0]
    with stand_ins(monkeypatch, variant):
        layer = mla_layer(build_kv_b_proj(variant))
        post_load(layer, torch.float32)
    rope = 64
    q_b_proj = torch.nn.Linear(32, HEADS * (NOPE + rope), bias=False)

    def absorption(q_c: torch.Tensor, w_uk_t: torch.Tensor) -> torch.Tensor:
        q = q_b_proj(q_c).view(-1, HEADS, NOPE + rope)
        q_nope, q_pe = q.split([NOPE, rope], dim=-1)
        ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk_t).transpose(0, 1)
        return torch.cat([ql_nope, q_pe], dim=-1)

    torch._dynamo.reset()
    q_c = torch.randn(5, 32)
    with torch.no_grad():  # Inductor's vectors are capped at 256 bits (conftest: why)
        eager = absorption(q_c, layer.W_UK_T)
        ab.reset_calls()
        compiled = torch.compile(absorption, fullgraph=True)(q_c, layer.W_UK_T)
    assert sum(v for k, v in ab.calls().items() if k.endswith("W_UK_T")) == 1
    # Inductor's q_b_proj and our op may sum in other orders than eager (fp32, any CPU):
    # q within 2 * 32 * 2**-24 of |q_c| @ |W_b|, then the 96-term bmm adds 2 * 96 * 2**-24
    # of |q| @ |W_UK_T| on top of carrying q's difference: |dq| @ |W_UK_T|.
    q_abs = (q_c.abs() @ q_b_proj.weight.detach().abs().T).view(-1, HEADS, NOPE + rope)
    dq = 32 * 2.0**-23 * q_abs
    w_abs = layer.W_UK_T.dense_values().float().abs()
    dql = torch.bmm((dq + NOPE * 2.0**-23 * q_abs)[..., :NOPE].transpose(0, 1), w_abs)
    tol = torch.cat([dql.transpose(0, 1), dq[..., NOPE:]], dim=-1)
    assert ((compiled - eager).abs() <= tol).all()
