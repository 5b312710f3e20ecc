"""The two patches that make ``reload_weights`` serve a new HY-V4 checkpoint on vLLM CPU
(``hyv4_sink_reload``, ``cpu_moe_reload_prepack``), on stand-in originals and vLLM's own
names; ``tests_e2e/test_hyv4_engine.py::test_reload_serves_the_second_checkpoint`` runs
them in a real engine (and fails without either)."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_mla.vllm.patches import (
    PATCHES,
    cpu_moe_reload_prepack,
    dsv4_sink_reload,
    glm5next_reload,
    hyv4_sink_reload,
    installed_minor,
)

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


def test_deepseek_v4s_sink_goes_through_its_weight_loader_too(rank_1_of_2):
    """The same loading for DeepSeek-V4's ``attn_sink`` (vLLM 0.32's CPU model copies it
    past any loader, as HY-V4's did)."""
    name = "layers.1.attn.attn_sink"
    seen: list[str] = []

    def original(self, weights):
        seen.extend(n for n, _ in weights)
        return set(seen)

    model = _TinyHYV4()
    model.named_parameters = lambda: iter([(name, model.sink)])
    loaded = dsv4_sink_reload.make_load_weights(original)(
        model, iter([("layers.1.attn.wkv.weight", torch.ones(1)), (name, torch.arange(4.0))])
    )
    assert seen == ["layers.1.attn.wkv.weight"] and name in loaded
    assert model.sink.tolist() == [2.0, 3.0]


def test_dsv4_sink_reload_targets_0_32_only():
    """vLLM 0.32's CPU V4 loader copies the sink itself; 0.33 and 0.34 build it with
    ``make_attention_sink`` and load it through that loader."""
    import inspect

    from vllm.models.deepseek_v4 import attention
    from vllm.models.deepseek_v4.cpu import model

    patch = _patch("dsv4_sink_reload")
    source = inspect.getsource(model.DeepseekV4Model.load_weights)
    if installed_minor() == "0.32":
        assert patch.upstream_in("0.32") is None
        assert "params_dict[name][:n].copy_(narrow_weight)" in source
    else:
        assert patch.upstream_in(installed_minor())
        assert "make_attention_sink" in inspect.getsource(attention)
        assert "attn_sink" not in source


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


# -- glm5next_reload ------------------------------------------------------------
def _indexer_type(module: str) -> type:
    return type("Indexer", (torch.nn.Module,), {"__module__": module})


def _indexer(module: str = glm5next_reload.INDEXER_MODULE) -> torch.nn.Module:
    """What the patch reads of GLM-5.3-Flash's Indexer: head_dim, wk_weights_proj and the
    fp32 copy its first forward makes (in inference mode, as vLLM's forward runs)."""
    indexer = _indexer_type(module)()
    indexer.head_dim = 4
    indexer.wk_weights_proj = torch.nn.Linear(8, 4 + 2, bias=False)
    with torch.inference_mode():
        indexer._wp_fp32 = glm5next_reload.head_weights_fp32(indexer)
    return indexer


def test_a_reload_refills_the_indexers_fp32_head_weights_in_place():
    model = torch.nn.Sequential(_indexer(), _indexer("elsewhere"))
    held = [m._wp_fp32 for m in model]
    pointers = [t.data_ptr() for t in held]
    with torch.no_grad():
        for m in model:
            m.wk_weights_proj.weight.add_(1.0)  # the reload's new weights
    finalize = glm5next_reload.make_finalize(lambda model, config: "done")
    assert finalize(model, None) == "done"
    assert [m._wp_fp32.data_ptr() for m in model] == pointers  # same storage
    want = model[0].wk_weights_proj.weight[4:].t().float()
    assert torch.equal(model[0]._wp_fp32, want)  # refilled
    assert not torch.equal(model[1]._wp_fp32, model[1].wk_weights_proj.weight[4:].t())


def test_an_indexer_without_its_copy_yet_is_left_alone():
    indexer = _indexer()
    indexer._wp_fp32 = None  # a first load: the first forward has not run
    assert glm5next_reload.refill(torch.nn.Sequential(indexer)) == 0


def _kda(module: str = glm5next_reload.KDA_MODULE) -> torch.nn.Module:
    """What the patch reads of GLM-5.3-Flash's KDA layer: its three short convolutions
    (``[C, 1, W]`` weights) and the merged copy its first forward makes."""
    kda = type("Glm5NextLinearAttention", (torch.nn.Module,), {"__module__": module})()
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = torch.nn.Module()
        conv.weight = torch.nn.Parameter(torch.randn(6, 1, 4))
        setattr(kda, name, conv)
    with torch.inference_mode():
        kda._merged_conv_weight = glm5next_reload.merged_conv_weight(kda)
    return kda


def test_a_reload_refills_the_kda_merged_convolution_in_place():
    model = torch.nn.Sequential(_kda(), _kda("elsewhere"))
    pointers = [m._merged_conv_weight.data_ptr() for m in model]
    with torch.no_grad():
        for m in model:
            m.v_conv1d.weight.add_(1.0)  # the reload's new weights
    glm5next_reload.make_finalize(lambda model, config: None)(model, None)
    assert [m._merged_conv_weight.data_ptr() for m in model] == pointers
    fresh = torch.cat(
        [model[0].q_conv1d.weight, model[0].k_conv1d.weight, model[0].v_conv1d.weight]
    )
    assert torch.equal(model[0]._merged_conv_weight, fresh.squeeze(1))  # refilled
    assert not torch.equal(model[1]._merged_conv_weight[12:], model[1].v_conv1d.weight.squeeze(1))


def test_vllms_kda_layer_keeps_the_copy_this_patch_refills():
    import importlib
    import inspect

    kda = importlib.import_module(glm5next_reload.KDA_MODULE)
    source = inspect.getsource(kda.Glm5NextLinearAttention)
    if _patch("glm5next_reload").upstream_in(installed_minor()) is None:  # 0.32 / 0.33
        assert "if self._merged_conv_weight is None:" in source
    else:  # 0.34: one fused conv1d parameter, read in every forward
        assert "_merged_conv_weight" not in source and "self.conv1d.weight.view(" in source


def test_vllms_indexer_keeps_the_copy_this_patch_refills():
    import importlib
    import inspect

    attention = importlib.import_module(glm5next_reload.INDEXER_MODULE)
    patch = _patch("glm5next_reload")
    minor = installed_minor()
    forward = inspect.getsource(attention.Indexer.forward)
    assert "self._wp_fp32" in forward
    if patch.upstream_in(minor) is None:  # 0.32 / 0.33: made once, in the first forward
        assert "if self._wp_fp32 is None" in forward
    else:  # 0.34: refilled at every post-load
        post_load = inspect.getsource(attention.Indexer.process_weights_after_loading)
        assert "refill_derived" in post_load
