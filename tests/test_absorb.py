"""The lean lifecycle: ordering, bounded scratch, release, transactions, reload, no-ops."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import FORMATS, make_layer, reference_pair
from torch import nn

from vllm_mla.memory import AllocationTrace
from vllm_mla.tools.standins import build_layer, source_tensors, synthetic_weight
from vllm_mla.weights import (
    LifecycleConfig,
    LifecycleError,
    PostLoadError,
    ReleaseRefusedError,
    baseline_post_load,
    faults,
    post_load,
)
from vllm_mla.weights.forms import read_source

RELEASE = LifecycleConfig(release_source=True, dense_mha_prefill=False)


def head_scratch(layer) -> int:
    """Scratch bytes the lifecycle declares for dequantizing one head of ``layer``."""
    source = read_source(layer.kv_b_proj)
    return (layer.qk_nope_head_dim + layer.v_head_dim) * source.reader.unit_bytes


def pair(layer):
    return layer.W_UK_T, layer.W_UV


def ptrs(layer):
    return [t.data_ptr() for t in pair(layer)]


def new_weights(layer, geo, fmt, seed):
    """Replace kv_b_proj's tensors the way a weight reload re-creates parameters."""
    fresh = make_layer(geo, fmt, seed=seed)
    for name, param in fresh.kv_b_proj.named_parameters():
        layer.kv_b_proj._parameters[name] = param


@pytest.mark.parametrize("fmt", FORMATS)
def test_pair_is_contiguous_and_exact(geo, fmt):
    layer = make_layer(geo, fmt)
    # a kept BF16 source is aliased instead (test below); with release it is copied
    report = post_load(layer, torch.bfloat16, RELEASE if fmt == "bf16" else None)
    assert report.action == "materialized"
    for got, want in zip(pair(layer), reference_pair(geo, fmt), strict=True):
        assert isinstance(got, nn.Parameter) and not got.requires_grad
        assert got.is_contiguous() and got.dtype == torch.bfloat16
        assert torch.equal(got, want)


def test_kept_dense_source_in_act_dtype_is_aliased_like_upstream(geo):
    lean, base = make_layer(geo, "bf16"), make_layer(geo, "bf16")
    baseline_post_load(base, torch.bfloat16)
    with AllocationTrace() as trace:
        report = post_load(lean, torch.bfloat16)
    assert report.action == "aliased" and trace.allocations() == []
    source = lean.kv_b_proj.weight
    for ours, theirs in zip(pair(lean), pair(base), strict=True):
        assert ours.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
        assert ours.stride() == theirs.stride() and torch.equal(ours, theirs)
    assert post_load(lean, torch.bfloat16).action == "noop"
    addresses = ptrs(lean)
    with torch.no_grad():
        source.copy_(make_layer(geo, "bf16", seed=4).kv_b_proj.weight)
    assert post_load(lean, torch.bfloat16, refresh=True).action == "aliased"
    assert ptrs(lean) == addresses
    assert torch.equal(lean.W_UK_T, reference_pair(geo, "bf16", seed=4)[0])


@pytest.mark.parametrize(
    ("fmt", "act", "config"),
    [("fp32", torch.bfloat16, None), ("bf16", torch.bfloat16, RELEASE)],
    ids=["other-dtype", "released"],
)
def test_dense_source_is_copied_when_aliasing_cannot_serve(geo, fmt, act, config):
    layer = make_layer(geo, fmt)
    assert post_load(layer, act, config).action == "materialized"
    assert all(t.is_contiguous() and t.dtype == act for t in pair(layer))


@pytest.mark.parametrize("fmt", FORMATS)
def test_lean_equals_baseline_bit_for_bit(geo, fmt):
    lean, base = make_layer(geo, fmt), make_layer(geo, fmt)
    post_load(lean, torch.bfloat16, RELEASE)
    baseline_post_load(base, torch.bfloat16)
    assert not base.W_UK_T.is_contiguous()  # upstream's views, which lean replaces
    for a, b in zip(pair(lean), pair(base), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["fp8-block", "mxfp8"])
def test_pair_is_allocated_before_any_scratch(geo, fmt):
    layer = make_layer(geo, fmt)
    config = LifecycleConfig(max_scratch_bytes=2 * head_scratch(layer))
    with AllocationTrace() as trace:
        report = post_load(layer, torch.bfloat16, config)
    allocs = trace.allocations()
    pair_bytes = [t.numel() * t.element_size() for t in pair(layer)]
    assert [a.size for a in allocs[:2]] == pair_bytes
    assert not any(a.freed for a in allocs[:2])
    assert any(a.freed for a in allocs[2:]), "expected dequant scratch after the pair"
    assert trace.persistent_bytes() == report.plan.pair_bytes


@pytest.mark.parametrize("fmt", ["fp8-block", "mxfp8"])
@pytest.mark.parametrize("heads", [1, 2, 4, 6])
def test_scratch_stays_within_the_plan(geo, fmt, heads):
    layer = make_layer(geo, fmt)
    bound = heads * head_scratch(layer) + 1
    with AllocationTrace() as trace:
        report = post_load(layer, torch.bfloat16, LifecycleConfig(max_scratch_bytes=bound))
    plan = report.plan
    assert plan.scratch_bound_bytes <= bound
    assert 0 < trace.transient_peak() <= plan.scratch_bound_bytes
    assert plan.heads_per_chunk == heads
    assert len(plan.chunks) == -(-geo.num_heads // heads)


def test_scratch_is_far_below_baseline(geo):
    """Block FP8: upstream widens the whole layer to float32 (scaled_dequantize)."""
    lean, base = make_layer(geo, "fp8-block"), make_layer(geo, "fp8-block")
    with AllocationTrace() as lean_trace:
        post_load(lean, torch.bfloat16, LifecycleConfig(max_scratch_bytes=head_scratch(lean)))
    with AllocationTrace() as base_trace:
        baseline_post_load(base, torch.bfloat16)
    whole_layer_fp32 = lean.kv_b_proj.weight.numel() * 4
    assert lean_trace.transient_peak() < whole_layer_fp32
    assert base_trace.transient_peak() >= whole_layer_fp32


def test_mxfp8_baseline_models_upstreams_identity_gemm(geo):
    """MXFP8: upstream runs ``apply(layer, eye)`` in the activation dtype (W8A8 kernels
    quantize the identity first); the [K, N] output is what the pair keeps."""
    base = make_layer(geo, "mxfp8")
    k = geo.model.kv_lora_rank
    rows = base.kv_b_proj.weight.shape[0]
    with AllocationTrace() as trace:
        baseline_post_load(base, torch.bfloat16)
    sizes = [a.size for a in trace.allocations()]
    assert k * k * 2 in sizes  # the bf16 identity
    assert k * k in sizes and k * k // 32 in sizes  # its e4m3 values and E8M0 scales
    assert rows * k * 2 in [a.size for a in trace.allocations() if not a.freed]  # kept output
    assert base.W_UK_T.untyped_storage().nbytes() == rows * k * 2


def test_scratch_bound_below_one_head_is_an_error(geo):
    layer = make_layer(geo, "mxfp8")
    with pytest.raises(LifecycleError, match="max_scratch_bytes=1000"):
        post_load(layer, torch.bfloat16, LifecycleConfig(max_scratch_bytes=1000))
    assert not hasattr(layer, "W_UK_T")


def test_release_is_refused_while_mha_prefill_needs_the_source(geo):
    layer = make_layer(geo, "mxfp8")
    weight = layer.kv_b_proj.weight
    config = LifecycleConfig(release_source=True, dense_mha_prefill=True)
    with pytest.raises(ReleaseRefusedError, match="MHA prefill"):
        post_load(layer, torch.bfloat16, config)
    assert layer.kv_b_proj.weight is weight and not hasattr(layer, "W_UK_T")


def test_source_is_kept_by_default(geo):
    layer = make_layer(geo, "mxfp8")
    weight = layer.kv_b_proj.weight
    report = post_load(layer, torch.bfloat16)
    assert report.released_bytes == 0 and layer.kv_b_proj.weight is weight


@pytest.mark.parametrize("fmt", FORMATS)
def test_release_frees_source_and_packed_storage(geo, fmt):
    layer = make_layer(geo, fmt)
    kv_b = layer.kv_b_proj
    kv_b.weight.weight_loader = "loader"  # vLLM hangs loaders on parameters
    params = dict(kv_b.named_parameters())
    refs = [weakref.ref(p.untyped_storage()) for p in params.values()]
    expected = sum(p.untyped_storage().nbytes() for p in params.values())
    report = post_load(layer, torch.bfloat16, RELEASE)
    gc.collect()
    assert report.released_bytes == expected
    assert all(r() is None for r in refs), "a released tensor is still referenced"
    for name, param in kv_b.named_parameters():
        assert param is params[name] and param.numel() == 0  # same object, reloadable
    assert kv_b.weight.weight_loader == "loader"
    for got, want in zip(pair(layer), reference_pair(geo, fmt), strict=True):
        assert torch.equal(got, want)


def test_release_frees_a_packed_owner(geo):
    """b12x's MXFP8 kernel empties weight/weight_scale and keeps a packed owner: that owner
    is the source, read directly and released."""
    layer = build_layer(geo, source_tensors(synthetic_weight(geo, seed=0, layer=0), "mxfp8-b12x"))
    kv_b = layer.kv_b_proj
    owner = kv_b.b12x_mxfp8_packed_weight
    tensors = [owner.weight.values, owner.weight.scale_rows, owner.weight.scale_mma]
    refs = [weakref.ref(t.untyped_storage()) for t in tensors]
    expected = sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )
    del owner, tensors
    reference = build_layer(geo, source_tensors(synthetic_weight(geo, seed=0, layer=0), "mxfp8"))
    post_load(reference, torch.bfloat16)
    report = post_load(layer, torch.bfloat16, RELEASE)
    gc.collect()
    assert report.released_bytes == expected
    assert kv_b.b12x_mxfp8_packed_weight is None and all(r() is None for r in refs)
    for got, want in zip(pair(layer), pair(reference), strict=True):
        assert torch.equal(got, want)
    assert post_load(layer, torch.bfloat16, RELEASE).action == "noop"


class Boom(RuntimeError):
    pass


def fail_on_call(monkeypatch, n):
    """Make the n-th dequantization chunk (1-based) raise, mid-materialization."""
    calls = []

    def injector(kind, name):
        if kind == "dequant":
            calls.append(name)
            if len(calls) == n:
                raise Boom("injected")

    monkeypatch.setattr(faults, "_injector", injector)  # the seam tests install through
    return calls


def test_failed_first_load_leaves_the_layer_untouched(geo, monkeypatch):
    layer = make_layer(geo, "mxfp8")
    before = {n: p.clone() for n, p in layer.kv_b_proj.named_parameters()}
    config = LifecycleConfig(
        release_source=True, dense_mha_prefill=False, max_scratch_bytes=head_scratch(layer)
    )
    fail_calls = fail_on_call(monkeypatch, 2)
    with pytest.raises(PostLoadError) as info:
        post_load(layer, torch.bfloat16, config)
    assert isinstance(info.value.__cause__, Boom)
    assert info.value.step == "dequant " + fail_calls[1]
    assert str(info.value).startswith(
        f"vllm-mla: absorbed-pair materialization failed at dequant {fail_calls[1]} "
        "(Boom: injected); every tensor of the layer is as it was (kv_b_proj's source intact, "
        "nothing released); post-load can be retried"
    )
    assert not hasattr(layer, "W_UK_T") and not hasattr(layer, "W_UV")
    for name, param in layer.kv_b_proj.named_parameters():
        assert torch.equal(param.view(torch.uint8), before[name].view(torch.uint8))
    monkeypatch.undo()
    assert post_load(layer, torch.bfloat16, config).action == "materialized"
    assert layer.kv_b_proj.weight.numel() == 0
    for got, want in zip(pair(layer), reference_pair(geo, "mxfp8"), strict=True):
        assert torch.equal(got, want)


def test_failed_reload_keeps_new_source_and_retries_in_place(geo, monkeypatch):
    layer = make_layer(geo, "mxfp8")
    config = LifecycleConfig(
        release_source=True, dense_mha_prefill=False, max_scratch_bytes=head_scratch(layer)
    )
    post_load(layer, torch.bfloat16, config)
    addresses = ptrs(layer)
    new_weights(layer, geo, "mxfp8", seed=7)
    fail_on_call(monkeypatch, 2)
    with pytest.raises(PostLoadError) as info:
        post_load(layer, torch.bfloat16, config)
    assert isinstance(info.value.__cause__, Boom)
    assert layer.kv_b_proj.weight.numel() > 0, "source released after a failure"
    monkeypatch.undo()
    assert post_load(layer, torch.bfloat16, config).action == "reloaded"
    assert ptrs(layer) == addresses
    for got, want in zip(pair(layer), reference_pair(geo, "mxfp8", seed=7), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", [LifecycleConfig(), RELEASE], ids=["keep", "release"])
def test_reload_keeps_addresses_and_takes_new_values(geo, fmt, config):
    layer = make_layer(geo, fmt)
    post_load(layer, torch.bfloat16, config)
    addresses = ptrs(layer)
    new_weights(layer, geo, fmt, seed=3)
    report = post_load(layer, torch.bfloat16, config)
    if fmt == "bf16" and not config.release_source:
        # aliased: a reload that copies in place keeps the views (vLLM's reload does);
        # a re-created parameter (this helper) gets the views rebound to it
        assert report.action == "aliased"
    else:
        assert report.action == "reloaded"
        assert report.pair == {"W_UK_T": "reused", "W_UV": "reused"}
        assert ptrs(layer) == addresses
    for got, want in zip(pair(layer), reference_pair(geo, fmt, seed=3), strict=True):
        assert torch.equal(got, want)
    assert (layer.kv_b_proj.weight.numel() == 0) == config.release_source


def test_in_place_weight_update_is_seen_as_new(geo):
    layer = make_layer(geo, "fp32")
    post_load(layer, torch.bfloat16)
    fresh = make_layer(geo, "fp32", seed=5).kv_b_proj.weight
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(fresh)
    assert post_load(layer, torch.bfloat16).action == "reloaded"
    assert torch.equal(layer.W_UK_T, reference_pair(geo, "fp32", seed=5)[0])


def test_writes_through_data_need_refresh(geo):
    """Loaders that write through .data (vLLM's reload) bypass the version counter."""
    layer = make_layer(geo, "fp32")
    post_load(layer, torch.bfloat16)
    fresh = make_layer(geo, "fp32", seed=6).kv_b_proj.weight
    layer.kv_b_proj.weight.data.copy_(fresh)
    assert post_load(layer, torch.bfloat16).action == "noop"
    assert post_load(layer, torch.bfloat16, refresh=True).action == "reloaded"
    assert torch.equal(layer.W_UK_T, reference_pair(geo, "fp32", seed=6)[0])


@pytest.mark.parametrize("config", [LifecycleConfig(), RELEASE], ids=["keep", "release"])
def test_post_load_twice_is_a_no_op(geo, config):
    layer = make_layer(geo, "mxfp8")
    post_load(layer, torch.bfloat16, config)
    addresses, values = ptrs(layer), [t.clone() for t in pair(layer)]
    with AllocationTrace() as trace:
        report = post_load(layer, torch.bfloat16, config)
    assert report.action == "noop" and trace.allocations() == []
    assert ptrs(layer) == addresses
    assert all(torch.equal(a, b) for a, b in zip(pair(layer), values, strict=True))


def test_strided_or_incompatible_storage_is_replaced_and_reported(geo):
    layer = make_layer(geo, "mxfp8")
    baseline_post_load(layer, torch.bfloat16)  # upstream's non-contiguous views
    layer.W_UV = nn.Parameter(layer.W_UV.detach().to(torch.float16), requires_grad=False)
    report = post_load(layer, torch.bfloat16)
    assert report.pair["W_UK_T"].startswith("replaced (strided")
    assert report.pair["W_UV"].startswith("replaced (dtype torch.float16")
    assert all(t.is_contiguous() and t.dtype == torch.bfloat16 for t in pair(layer))


def test_compatible_storage_is_adopted_in_place(geo):
    layer = make_layer(geo, "fp8-block")
    shapes = [tuple(t.shape) for t in reference_pair(geo, "fp8-block")]
    for name, shape in zip(("W_UK_T", "W_UV"), shapes, strict=True):
        layer.register_parameter(
            name, nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
        )
    addresses = ptrs(layer)
    report = post_load(layer, torch.bfloat16)
    assert report.pair == {"W_UK_T": "reused", "W_UV": "reused"} and ptrs(layer) == addresses


def test_post_load_before_weights_is_an_error(geo):
    layer = make_layer(geo, "bf16")
    layer.kv_b_proj._parameters["weight"] = nn.Parameter(
        torch.empty(0, geo.model.kv_lora_rank, dtype=torch.bfloat16), requires_grad=False
    )
    with pytest.raises(LifecycleError, match="no source tensors"):
        post_load(layer, torch.bfloat16)


def test_geometry_mismatch_names_the_shapes(geo):
    layer = make_layer(geo, "mxfp8")
    layer.num_heads = 5
    with pytest.raises(LifecycleError, match=r"expected \(440, 64\)"):
        post_load(layer, torch.bfloat16)
