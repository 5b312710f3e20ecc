"""Direct mode on every MXFP8 form of the kv_b_proj matrix: views of the pack instead of a
BF16 pair, the same function, no allocation, stable addresses through a reload,
transactional failures, and the refusals that name their reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_mla.memory import AllocationTrace, Ledger
from vllm_mla.ops import absorbed_matmul as ab
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.tools.qualify import load_into
from vllm_mla.tools.standins import build_layer, source_tensors, synthetic_weight
from vllm_mla.weights import LifecycleConfig, PostLoadError, baseline_post_load, faults, post_load
from vllm_mla.weights.direct import DirectModeError
from vllm_mla.weights.sources import module_tensors

DIRECT = LifecycleConfig(absorbed="direct")
DIRECT_RELEASE = LifecycleConfig(absorbed="direct", release_source=True, dense_mha_prefill=False)
FORMS = ("mxfp8", "mxfp8-flashinfer", "mxfp8-cutedsl", "mxfp8-b12x")
PAIR = ("W_UK_T", "W_UV")


def held(geo, name, seed=0):
    return source_tensors(synthetic_weight(geo, seed=seed, layer=0), name)


def layer_of(geo, name, seed=0):
    return build_layer(geo, held(geo, name, seed))


def baseline_pair(geo, name, seed=0, dtype=torch.bfloat16):
    ref = layer_of(geo, name, seed)
    baseline_post_load(ref, dtype)
    return {n: getattr(ref, n) for n in PAIR}


def pointers(layer):
    return [t.data_ptr() for n in PAIR for t in getattr(layer, n).inner_tensors()]


@pytest.mark.parametrize("name", FORMS)
def test_views_hold_exactly_the_baseline_pair(geo, name):
    layer = layer_of(geo, name)
    report = post_load(layer, torch.bfloat16, DIRECT)
    assert report.action == "direct"
    for n, want in baseline_pair(geo, name).items():
        got = getattr(layer, n)
        assert isinstance(got, AbsorbedWeight) and got.kind == "mxfp8" and got.role == n
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert torch.equal(got.dense_values(), want)


@pytest.mark.parametrize("name", FORMS)
def test_decode_step_computes_what_the_bf16_pair_computes(geo, name):
    layer = layer_of(geo, name)
    post_load(layer, torch.float32, DIRECT)
    ref = baseline_pair(geo, name, dtype=torch.float32)
    n, p, lat = geo.num_heads, geo.model.qk_nope_head_dim, geo.model.kv_lora_rank
    q = torch.randn(3, n, p)
    x = torch.randn(3, n, lat)
    out = torch.empty(3, n, lat)
    torch.bmm(q.transpose(0, 1), layer.W_UK_T, out=out.transpose(0, 1))
    assert_fp32_order_close(out.transpose(0, 1), q.transpose(0, 1), ref["W_UK_T"])
    v = torch.bmm(x.transpose(0, 1), layer.W_UV)
    assert_fp32_order_close(v, x.transpose(0, 1), ref["W_UV"])


def assert_fp32_order_close(got, a, w):
    """``got`` (the MXFP8 views' kernel) vs torch.bmm on the exact fp32 decode ``w``: two
    fp32 sums of K terms in different orders, each within K * 2**-24 of sum|terms|."""
    tol = a.shape[-1] * 2.0**-23 * torch.bmm(a.abs(), w.abs())
    assert ((got - torch.bmm(a, w)).abs() <= tol).all()


@pytest.mark.parametrize("name", ["mxfp8", "mxfp8-b12x"])
def test_no_pair_is_allocated_and_the_ledger_counts_the_pack(geo, name):
    layer = layer_of(geo, name)
    pack = Ledger().add_layer(layer)
    with AllocationTrace("cpu") as trace:
        post_load(layer, torch.bfloat16, DIRECT)
    assert trace.persistent_bytes() == 0
    row = Ledger().add_layer(layer)
    assert row["absorbed"] + row["source"] + row["packed"] == sum(pack.values())
    assert row["absorbed"] > 0 and row["source"] == 0


@pytest.mark.parametrize("name", ["mxfp8-flashinfer", "mxfp8-cutedsl"])
def test_swizzled_scales_are_unswizzled_once_and_released_when_allowed(geo, name):
    kept, freed = layer_of(geo, name), layer_of(geo, name)
    post_load(kept, torch.bfloat16, DIRECT)
    post_load(freed, torch.bfloat16, DIRECT_RELEASE)
    values = module_tensors(freed.kv_b_proj)["weight"]
    rows = Ledger().add_layer(kept), Ledger().add_layer(freed)
    scales = values.numel() // 32  # one E8M0 byte per 32 values: our unswizzled copy
    assert rows[0]["absorbed"] == values.untyped_storage().nbytes() + scales
    assert rows[0]["source"] > 0 and rows[1]["source"] == 0
    assert module_tensors(freed.kv_b_proj)["weight_scale"].numel() == 0
    assert post_load(freed, torch.bfloat16, DIRECT_RELEASE).action == "noop"


@pytest.mark.parametrize("config", [DIRECT, DIRECT_RELEASE], ids=["kept", "released"])
@pytest.mark.parametrize("name", FORMS)
def test_reload_refreshes_the_pack_in_place(geo, name, config):
    layer = layer_of(geo, name)
    post_load(layer, torch.bfloat16, config)
    before = pointers(layer)
    load_into(layer, held(geo, name, seed=1), torch.device("cpu"))  # new tensors, as a reload
    assert post_load(layer, torch.bfloat16, config, refresh=True).action == "direct-reloaded"
    assert pointers(layer) == before
    for n, want in baseline_pair(geo, name, seed=1).items():
        assert torch.equal(getattr(layer, n).dense_values(), want)
    # kv_b_proj reads the same storage again (it stays callable where it is kept)
    values = module_tensors(layer.kv_b_proj).get("weight")
    if name != "mxfp8-b12x":
        assert (
            values.untyped_storage().data_ptr() == layer.W_UK_T._values.untyped_storage().data_ptr()
        )


def test_a_second_post_load_with_nothing_new_is_a_noop(geo):
    layer = layer_of(geo, "mxfp8")
    post_load(layer, torch.bfloat16, DIRECT)
    assert post_load(layer, torch.bfloat16, DIRECT).action == "noop"


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("site", ["alloc", "release", "copy"])
def test_a_fault_leaves_the_layer_as_it_was(geo, site):
    layer = layer_of(geo, "mxfp8-flashinfer")
    post_load(layer, torch.bfloat16, DIRECT_RELEASE)
    load_into(layer, held(geo, "mxfp8-flashinfer", seed=1), torch.device("cpu"))
    state = {k: (v.data_ptr(), v.clone()) for k, v in module_tensors(layer.kv_b_proj).items()}
    pair = {n: getattr(layer, n).dense_values().clone() for n in PAIR}
    seen = []

    def fail(kind, name):
        seen.append(kind)
        if kind == site:
            raise Boom(f"{kind} {name}")

    with faults.inject(fail), pytest.raises(PostLoadError) as info:
        post_load(layer, torch.bfloat16, DIRECT_RELEASE, refresh=True)
    assert site in seen and isinstance(info.value.__cause__, Boom)
    assert info.value.step.startswith(site)
    assert "direct-mode binding failed at " in str(info.value)
    assert "layer is as it was (pack intact, nothing released)" in str(info.value)
    for k, (ptr, value) in state.items():
        now = module_tensors(layer.kv_b_proj)[k]
        assert now.data_ptr() == ptr and torch.equal(now.view(torch.uint8), value.view(torch.uint8))
    for n in PAIR:
        assert torch.equal(getattr(layer, n).dense_values(), pair[n])
    post_load(layer, torch.bfloat16, DIRECT_RELEASE, refresh=True)  # a retry succeeds
    for n, want in baseline_pair(geo, "mxfp8-flashinfer", seed=1).items():
        assert torch.equal(getattr(layer, n).dense_values(), want)


@pytest.mark.parametrize(
    "name,match",
    [
        ("bf16", "needs an MXFP8 pack on kv_b_proj; this one is form 'bf16'"),
        ("fp8-block", "form 'fp8-block'"),
        ("mxfp8-emulation", "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=0"),
        ("mxfp8-marlin", "form 'mxfp8-marlin'"),
    ],
)
def test_forms_without_a_pack_are_refused_by_name(geo, name, match):
    layer = layer_of(geo, name)
    with pytest.raises(DirectModeError, match=match):
        post_load(layer, torch.bfloat16, DIRECT)
    assert not isinstance(getattr(layer, "W_UK_T", None), AbsorbedWeight)


def test_fp16_and_dcp_replication_are_refused(geo):
    with pytest.raises(DirectModeError, match=r"activation dtype torch\.float16"):
        post_load(layer_of(geo, "mxfp8"), torch.float16, DIRECT)
    layer = layer_of(geo, "mxfp8")
    layer.dcp_q_replicate = True
    with pytest.raises(DirectModeError, match="DCP query replication"):
        post_load(layer, torch.bfloat16, DIRECT)


def test_the_bf16_lifecycle_unwraps_a_safe_route_and_keeps_its_storage(geo):
    from vllm_mla.weights.route import bind_safe

    layer = layer_of(geo, "mxfp8")
    post_load(layer, torch.bfloat16)
    ptrs = [getattr(layer, n).data_ptr() for n in PAIR]
    assert bind_safe(layer) == list(PAIR)
    assert [getattr(layer, n)._values.data_ptr() for n in PAIR] == ptrs
    load_into(layer, held(geo, "mxfp8", seed=1), torch.device("cpu"))
    assert post_load(layer, torch.bfloat16, refresh=True).action == "reloaded"
    assert [getattr(layer, n).data_ptr() for n in PAIR] == ptrs  # plain again, same storage
    ab.reset_calls()
    bind_safe(layer)
    torch.bmm(torch.randn(geo.num_heads, 2, geo.model.qk_nope_head_dim).bfloat16(), layer.W_UK_T)
    assert ab.calls() == {"safe:W_UK_T": 1}


def test_config_names_a_bad_mode():
    from vllm_mla.weights import LifecycleError

    with pytest.raises(LifecycleError, match="absorbed must be one of"):
        dataclasses.replace(DIRECT, absorbed="fp8")
