"""The query feature: MLA's V up-projection through the safe BMM where it is needed."""

from __future__ import annotations

import pytest
import torch
from conftest import L, N, V, mla_layer
from vllm.model_executor.layers.attention import mla_attention

from vllm_mla.backends import capabilities
from vllm_mla.backends.capabilities import BackendCapabilities
from vllm_mla.vllm import telemetry
from vllm_mla.vllm.patches import mla_v_up_proj

STOCK_V_UP = mla_attention.MLAAttention._v_up_proj


@pytest.fixture(autouse=True)
def _quiet_default_scales(monkeypatch):
    # vLLM's own CPU test stubs this too: it needs a real vllm_config.
    monkeypatch.setattr(mla_attention, "set_default_quant_scales", lambda *a, **k: None)


@pytest.fixture
def safe_backend(monkeypatch):
    name = "TEST_NEEDS_SAFE_BMM"
    caps = BackendCapabilities(name, needs_safe_query_bmm=True)
    monkeypatch.setitem(capabilities.CAPABILITIES, name, caps)
    return name


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = mla_v_up_proj.safe_mla_query_bmm

    def spy(query, weight, out):
        seen.append(tuple(query.shape))
        return real(query, weight, out)

    monkeypatch.setattr(mla_v_up_proj, "safe_mla_query_bmm", spy)
    return seen


def layer_with_pair(backend=None, fmt="fp8-block"):
    layer = mla_layer(fmt, backend=backend)
    with torch.no_grad():  # the plugin's post-load when registered: a contiguous W_UV
        layer.process_weights_after_loading(torch.bfloat16)
    return layer


def run(layer, tokens=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, N * L, generator=gen).bfloat16()
    out = torch.full((tokens, N * V), float("nan"), dtype=torch.bfloat16)
    with torch.no_grad():
        layer._v_up_proj(x, out)
    return x, out


def stock(layer, x):
    out = torch.empty(x.shape[0], N * V, dtype=torch.bfloat16)
    with torch.no_grad():
        STOCK_V_UP(layer, x, out)
    return out


def test_needed_by_capability_runs_the_safe_op(registered, safe_backend, calls):
    layer = layer_with_pair(safe_backend)
    x, out = run(layer)
    assert calls == [(N, 7, L)]
    assert torch.equal(out, stock(layer, x))


@pytest.mark.parametrize(
    ("mode", "path"),
    [("always", "v_up_proj:safe_bmm"), ("never", "v_up_proj:original"), ("auto", None)],
)
def test_env_override_and_recorded_path(registered, monkeypatch, calls, mode, path):
    monkeypatch.setenv("VLLM_MLA_SAFE_BMM", mode)
    telemetry.reset()
    layer = layer_with_pair()  # no capability, not a GPU: auto keeps the original
    x, out = run(layer)
    path = path or "v_up_proj:original"
    assert telemetry.snapshot()["query"] == {path: 1}
    assert calls == ([(N, 7, L)] if mode == "always" else [])
    assert torch.equal(out, stock(layer, x))


def test_env_override_rejects_unknown_values(registered, monkeypatch):
    monkeypatch.setenv("VLLM_MLA_SAFE_BMM", "sometimes")
    with pytest.raises(ValueError, match="VLLM_MLA_SAFE_BMM must be one of"):
        run(layer_with_pair())


def test_bf16_views_take_the_copy_workaround(registered, safe_backend, calls):
    layer = layer_with_pair(safe_backend, fmt="bf16")  # W_UV: upstream's transposed view
    assert layer.W_UV.stride(-1) != 1
    x, out = run(layer)
    assert calls == []
    assert torch.equal(out, stock(layer, x))


def test_not_needed_runs_the_original_untouched(registered, calls):
    layer = layer_with_pair()
    x, out = run(layer)
    assert calls == []
    assert torch.equal(out, stock(layer, x))


def test_own_bmm_layers_never_take_it(registered, safe_backend):
    layer = layer_with_pair(safe_backend)
    layer.is_amx_bmm_enabled = True
    assert not mla_v_up_proj.needs_safe_bmm(layer, torch.device("cpu"))


def test_decided_once_per_layer(registered, safe_backend, calls, monkeypatch):
    layer = layer_with_pair(safe_backend)
    run(layer)
    monkeypatch.setitem(capabilities.CAPABILITIES, safe_backend, BackendCapabilities(safe_backend))
    run(layer, seed=1)
    assert len(calls) == 2  # the first decision stands for the layer's lifetime


@pytest.mark.parametrize(
    ("capability", "expected"), [((12, 0), True), ((12, 1), True), ((9, 0), False)]
)
def test_sm12x_gpus_need_it(registered, monkeypatch, capability, expected):
    layer = layer_with_pair()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert mla_v_up_proj.needs_safe_bmm(layer, torch.device("cuda")) is expected
    assert not mla_v_up_proj.needs_safe_bmm(layer, torch.device("cpu"))
