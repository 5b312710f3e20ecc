"""The two patches that make ``reload_weights`` serve a new HY-V4 checkpoint on vLLM CPU
(``hyv4_sink_reload``, ``cpu_moe_reload_prepack``), on stand-in originals and vLLM's own
names; ``tests_e2e/test_hyv4_engine.py::test_reload_serves_the_second_checkpoint`` runs
them in a real engine (and fails without either)."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_mla.vllm.patches import PATCHES, cpu_moe_reload_prepack, hyv4_sink_reload, installed_minor

SINK = "layers.0.self_attn.learnable_sink_param"


def _patch(name: str):
    return next(p for p in PATCHES if p.name == name)


class _TinyHYV4:
    """What ``HYV4Model.load_weights`` reads of its model: config and parameters."""

    def __init__(self) -> None:
        self.config = types.SimpleNamespace(num_attention_heads=4)
        self.sink = torch.nn.Parameter(torch.zeros(2), requires_grad=False)

    def named_parameters(self):
        return iter([(SINK, self.sink)])


@pytest.fixture
def rank_1_of_2(monkeypatch):
    import vllm.distributed as dist

    monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_tensor_model_parallel_rank", lambda: 1)


def test_the_sink_goes_through_its_weight_loader_and_the_rest_streams(rank_1_of_2):
    seen: list[str] = []

    def original(self, weights):
        seen.extend(name for name, _ in weights)
        return set(seen)

    load = hyv4_sink_reload.make_load_weights(original)
    model = _TinyHYV4()
    sink = torch.arange(4.0)
    loaded = load(model, iter([("layers.0.mlp.w", torch.ones(1)), (SINK, sink)]))
    assert seen == ["layers.0.mlp.w"]  # the original never sees the sink
    assert loaded == {"layers.0.mlp.w", SINK}
    assert model.sink.tolist() == [2.0, 3.0]  # rank 1's heads
    assert model.sink.weight_loader is hyv4_sink_reload.load_sink_heads
    # a reload wraps the loader (vLLM's layerwise online_process_loader): it is called
    calls = []
    model.sink.weight_loader = lambda param, w: calls.append(w.tolist())
    load(model, iter([(SINK, sink + 10)]))
    assert calls == [[12.0, 13.0]]


def test_hyv4_sink_reload_targets_0_32_only():
    patch = _patch("hyv4_sink_reload")
    minor = installed_minor()
    if minor == "0.32":
        assert patch.upstream_in(minor) is None
    else:  # 0.33 and later build the sink with a weight loader reload can wrap
        from vllm.model_executor.model_loader.weight_utils import make_attention_sink

        assert patch.upstream_in(minor)
        assert callable(make_attention_sink(4, torch.float32).weight_loader)


class _Method:
    def __init__(self, experts: object) -> None:
        self.moe_kernel = None
        self._experts = experts

    def original(self, layer, w13, w2):  # builds the kernel on first load only
        if self.moe_kernel is None:
            self.moe_kernel = types.SimpleNamespace(fused_experts=self._experts)


def _experts(module: str):
    calls = []
    cls = type("Experts", (), {"__module__": module})
    cls.process_weights_after_loading = lambda self, layer: calls.append(layer)
    return cls(), calls


@pytest.mark.parametrize("module", [cpu_moe_reload_prepack.CPU_EXPERTS_MODULE, "other.experts"])
def test_a_weight_update_prepacks_only_vllm_cpus_experts(module):
    experts, calls = _experts(module)
    method = _Method(experts)
    setup = cpu_moe_reload_prepack.make_setup_kernel(lambda self, *a: self.original(*a))
    setup(method, "layer", None, None)  # first load: the original's own post-load
    assert calls == []
    setup(method, "layer", None, None)  # the reload
    assert calls == (["layer"] if module == cpu_moe_reload_prepack.CPU_EXPERTS_MODULE else [])


def test_the_cpu_experts_module_is_vllms():
    import importlib

    patch = _patch("cpu_moe_reload_prepack")
    assert patch.platforms == ("cpu",)
    module = importlib.import_module(cpu_moe_reload_prepack.CPU_EXPERTS_MODULE)
    assert any(
        "process_weights_after_loading" in vars(cls)
        for cls in vars(module).values()
        if isinstance(cls, type) and cls.__module__ == module.__name__
    )
