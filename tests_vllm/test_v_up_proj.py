"""The query feature: MLA's V up-projection through the safe BMM where it is needed.

With the default features the post-load patch binds the pair as routed weights, so
upstream's own ``_v_up_proj`` bmm runs our op (``v_up_proj:routed``); with only the
``query`` feature (no lifecycle, no route) the ``_v_up_proj`` patch runs the safe op
itself.
"""

from __future__ import annotations

import pytest
import torch
from conftest import L, N, V, mla_layer
from vllm_layers import post_load

from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.vllm import capabilities, plugin, telemetry
from vllm_mla.vllm.capabilities import BackendCapabilities
from vllm_mla.vllm.patches import mla_v_up_proj

pytestmark = pytest.mark.usefixtures("no_default_quant_scales")


@pytest.fixture
def safe_backend(monkeypatch):
    name = "TEST_NEEDS_SAFE_BMM"
    caps = BackendCapabilities(name, needs_safe_query_bmm=True)
    monkeypatch.setitem(capabilities.CAPABILITIES, name, caps)
    return name


@pytest.fixture
def calls(monkeypatch):
    """Shapes of the ``_v_up_proj`` patch's own safe-op calls (the unrouted path)."""
    seen = []
    real = mla_v_up_proj.safe_mla_query_bmm

    def spy(query, weight, out):
        seen.append(tuple(query.shape))
        return real(query, weight, out)

    monkeypatch.setattr(mla_v_up_proj, "safe_mla_query_bmm", spy)
    return seen


@pytest.fixture
def query_only(monkeypatch):
    """The plugin with the ``query`` feature alone: no lifecycle, so no route."""
    monkeypatch.delenv("VLLM_MLA", raising=False)
    monkeypatch.setenv("VLLM_MLA_FEATURES", "query")
    plugin.reset()
    yield plugin.register()
    plugin.reset()


def layer_with_pair(backend=None, fmt="fp8-block"):
    layer = mla_layer(fmt, backend=backend)
    with torch.no_grad():
        post_load(layer, torch.bfloat16)
    return layer


def run(layer, tokens=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, N * L, generator=gen).bfloat16()
    out = torch.full((tokens, N * V), float("nan"), dtype=torch.bfloat16)
    telemetry.reset()
    with torch.no_grad():
        layer._v_up_proj(x, out)
    return x, out


def plain(layer, x):
    """Stock ``_v_up_proj`` on a plain copy of the layer's W_UV (no route, no patch)."""
    w = layer.W_UV.dense_values() if isinstance(layer.W_UV, AbsorbedWeight) else layer.W_UV
    x = x.view(-1, N, L).transpose(0, 1)
    return torch.bmm(x, w).transpose(0, 1).reshape(-1, N * V)


def test_needed_by_capability_routes_the_pair(registered, safe_backend, calls):
    layer = layer_with_pair(safe_backend)
    assert isinstance(layer.W_UV, AbsorbedWeight) and layer.W_UV.kind == "dense"
    x, out = run(layer)
    assert telemetry.snapshot()["query"] == {"v_up_proj:routed": 1}
    assert telemetry.snapshot()["absorbed"] == {"safe:W_UV": 1}
    assert calls == []  # upstream's own bmm took the route
    assert torch.equal(out, plain(layer, x))


@pytest.mark.parametrize(
    ("mode", "path"),
    [("always", "v_up_proj:routed"), ("never", "v_up_proj:original"), ("auto", None)],
)
def test_env_override_and_recorded_path(registered, monkeypatch, mode, path):
    monkeypatch.setenv("VLLM_MLA_SAFE_BMM", mode)
    layer = layer_with_pair()  # no capability, not a GPU: auto keeps the original
    x, out = run(layer)
    path = path or "v_up_proj:original"
    assert telemetry.snapshot()["query"] == {path: 1}
    routed = mode == "always"
    assert isinstance(layer.W_UV, AbsorbedWeight) is routed
    assert telemetry.snapshot()["absorbed"] == ({"safe:W_UV": 1} if routed else {})
    assert torch.equal(out, plain(layer, x))


def test_env_override_rejects_unknown_values(registered, monkeypatch):
    monkeypatch.setenv("VLLM_MLA_SAFE_BMM", "sometimes")
    with pytest.raises(ValueError, match="VLLM_MLA_SAFE_BMM must be one of"):
        layer_with_pair()


def test_bf16_views_are_routed_on_the_copy_path(registered, safe_backend):
    layer = layer_with_pair(safe_backend, fmt="bf16")  # W_UV: upstream's transposed view
    assert layer.W_UV._values.stride(-1) != 1
    x, out = run(layer)
    # not the safe op (it needs a contiguous last dim): torch.bmm, on contiguous operands
    # where cuBLAS over-reads (SM12x)
    assert telemetry.snapshot()["absorbed"] == {"torch:W_UV": 1}
    assert torch.equal(out, plain(layer, x))


def test_not_needed_runs_the_original_untouched(registered, calls):
    layer = layer_with_pair()
    assert not isinstance(layer.W_UV, AbsorbedWeight)
    x, out = run(layer)
    assert calls == [] and telemetry.snapshot()["absorbed"] == {}
    assert torch.equal(out, plain(layer, x))


def test_own_bmm_layers_never_take_it(registered, safe_backend):
    layer = layer_with_pair(safe_backend)
    layer.is_amx_bmm_enabled = True
    assert not mla_v_up_proj.needs_safe_bmm(layer, torch.device("cpu"))


def test_the_route_is_bound_once_at_post_load(registered, safe_backend, monkeypatch):
    layer = layer_with_pair(safe_backend)
    run(layer)
    monkeypatch.setitem(capabilities.CAPABILITIES, safe_backend, BackendCapabilities(safe_backend))
    run(layer, seed=1)
    assert telemetry.snapshot()["absorbed"] == {"safe:W_UV": 1}  # still routed


def test_query_feature_alone_runs_the_safe_op_in_the_patch(query_only, safe_backend, calls):
    assert set(query_only) == {"query"}
    layer = layer_with_pair(safe_backend)  # stock post-load: a transposed W_UV view
    assert not isinstance(layer.W_UV, AbsorbedWeight)
    x, out = run(layer)
    assert telemetry.snapshot()["query"] == {"v_up_proj:contiguous_copy": 1}
    assert torch.equal(out, plain(layer, x))
    layer.W_UV = torch.nn.Parameter(layer.W_UV.contiguous(), requires_grad=False)
    x, out = run(layer, seed=1)
    assert telemetry.snapshot()["query"] == {"v_up_proj:safe_bmm": 1}
    assert calls == [(N, 7, L)]
    assert torch.equal(out, plain(layer, x))


def test_query_feature_alone_decides_once_per_layer(query_only, safe_backend, calls, monkeypatch):
    layer = layer_with_pair(safe_backend)
    layer.W_UV = torch.nn.Parameter(layer.W_UV.contiguous(), requires_grad=False)
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
