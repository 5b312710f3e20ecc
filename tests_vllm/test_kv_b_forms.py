"""The kv_b_proj matrix on vLLM's real layers: every row, every kernel variant (CPU).

For each variant (``vllm_layers.VARIANTS``: a quant method and the kernel vLLM selects):
the form is detected; the plugin's pair is bit-identical to vLLM's original post-load on
an identical layer; release frees every source tensor (and is refused with dense MHA
prefill); vLLM's own layerwise reload refills the pair in place with the new values and
releases again; qualify's model of the row holds the same bytes (and, for rows our codecs
read, allocates the same transient peak) as the plugin's ledger measures on the real layer;
and a failure injected at every allocation, copy, dequant chunk and release step leaves
every tensor of the layer as it was, after which post-load succeeds.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch
import vllm_layers
from safetensors.torch import save_file
from vllm.model_executor.layers.attention import mla_attention
from vllm_layers import FAULT_SITES, Variant, build_kv_b_proj, installed, mla_layer, stand_ins

from vllm_mla.memory import AllocationTrace, Ledger
from vllm_mla.tools.qualify import QualifyConfig, run_qualify
from vllm_mla.vllm import telemetry
from vllm_mla.weights import FORMS, PostLoadError, ReleaseRefusedError, faults, forms
from vllm_mla.weights.sources import holds_weights

STOCK = mla_attention.MLAAttention.process_weights_after_loading
VARIANTS = installed()
SPARSE = "B12X_MLA_SPARSE"
pytestmark = [
    pytest.mark.parametrize("variant", VARIANTS, ids=[v.id for v in VARIANTS]),
    pytest.mark.usefixtures("no_default_quant_scales"),
]


@pytest.fixture
def built(monkeypatch, variant):
    """Build layers of ``variant`` (stand-ins active for the whole test)."""
    with stand_ins(monkeypatch, variant):

        def build(seed=0, backend=None, dense_prefill=True):
            return mla_layer(build_kv_b_proj(variant, seed), backend, dense_prefill)

        yield build


def pair(layer):
    return layer.W_UK_T, layer.W_UV


def upstream(build, seed=0):
    layer = build(seed)
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16, STOCK)
    return layer


def test_detected_as_its_row(variant, built):
    found, why = forms.detect(built().kv_b_proj)
    assert found is not None, why
    assert found.name == variant.form


@pytest.mark.parametrize("backend", [None, SPARSE])
def test_pair_is_bit_identical_to_upstream(registered, variant, built, backend):
    layer = built(backend=backend, dense_prefill=backend is None)
    telemetry.reset()
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16)
    ((_, action),) = telemetry.snapshot()["post_load"]
    assert action in ("materialized", "aliased"), action
    for ours, theirs in zip(pair(layer), pair(upstream(built)), strict=True):
        assert isinstance(ours, torch.nn.Parameter)
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_release_frees_every_source_tensor(registered, variant, built):
    layer = built(backend=SPARSE, dense_prefill=False)
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16)
    row = Ledger().add_layer(layer)
    assert row["source"] == 0 and row["packed"] == 0
    for tensor in vllm_layers.layer_tensors(layer).values():
        assert tensor.numel() == 0 or tensor is layer.W_UK_T or tensor is layer.W_UV


def test_released_parameters_keep_their_objects_and_loaders(registered, variant, built):
    layer = built(backend=SPARSE, dense_prefill=False)
    params = dict(layer.kv_b_proj.named_parameters())
    loaders = {n: getattr(p, "weight_loader", None) for n, p in params.items()}
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16)
    for name, param in layer.kv_b_proj.named_parameters():
        assert param is params[name] and type(param) is type(params[name])
        assert getattr(param, "weight_loader", None) is loaders[name]


def test_release_is_refused_with_dense_mha_prefill(registered, variant, built):
    layer = built(backend=SPARSE, dense_prefill=True)
    before = vllm_layers.snapshot(layer)
    with pytest.raises(ReleaseRefusedError, match="MHA prefill"), torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16)
    assert vllm_layers.same_as(layer, before) == []


@pytest.mark.parametrize("backend", [None, SPARSE])
def test_vllm_reload_keeps_addresses_and_takes_new_values(registered, variant, built, backend):
    model = vllm_layers.build_model(variant, backend=backend, dense_prefill=backend is None)
    with torch.no_grad():
        vllm_layers.post_load(model.attn, torch.bfloat16)
    before = [t.data_ptr() for t in pair(model.attn)]
    vllm_layers.reload_through_vllm(model, variant, seed=2)
    assert [t.data_ptr() for t in pair(model.attn)] == before
    for ours, theirs in zip(pair(model.attn), pair(upstream(built, seed=2)), strict=True):
        assert torch.equal(ours, theirs)
    kept = holds_weights(model.attn.kv_b_proj, forms.PACKED_ATTRS)
    assert kept == (backend != SPARSE)


def _qualify_on(tmp_path, variant) -> dict:
    """qualify over a one-layer model folder holding this variant's checkpoint."""
    config = json.loads(vllm_layers._TINY_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = vllm_layers.checkpoint(variant.checkpoint)
    save_file(
        {f"{vllm_layers.PREFIX}.{name}": t.contiguous() for name, t in ckpt.items()},
        tmp_path / "model.safetensors",
    )
    return run_qualify(QualifyConfig(model=str(tmp_path), tp=1, weights=variant.form))


def test_qualify_models_the_real_layer(registered, variant, built, tmp_path):
    report = _qualify_on(tmp_path, variant)
    assert report["checks"]["parity_ok"] and not report["notes"][1:]
    base = built()
    with torch.no_grad():
        vllm_layers.post_load(base, torch.bfloat16, STOCK)
    lean = built(backend=SPARSE, dense_prefill=False)
    with AllocationTrace() as trace, torch.no_grad():
        vllm_layers.post_load(lean, torch.bfloat16)
    measured = {"baseline": Ledger().add_layer(base), "lean": Ledger().add_layer(lean)}
    for phase, row in measured.items():
        for owner in ("absorbed", "source", "packed"):
            assert row[owner] == report[phase][f"{owner}_bytes"], (phase, owner)
    if forms.form(variant.form).bounded:
        assert trace.transient_peak() == report["lean"]["peak_transient_bytes"]
        assert (
            trace.transient_peak() <= report["scratch_bound_bytes"]
            or report["scratch_bound_bytes"] == 0
        )


def _sites(run) -> list[tuple[str, str]]:
    seen = []
    with faults.inject(lambda kind, name: seen.append((kind, name))):
        run()
    return seen


class Injected(RuntimeError):
    pass


def _fail_at(index: int):
    count = [0]

    def injector(kind, name):
        count[0] += 1
        if count[0] == index + 1:
            raise Injected(f"{kind} {name}")

    return injector


def _assert_one_clear_error(info, layer, site: tuple[str, str]) -> None:
    """The fault surfaces as one PostLoadError naming the layer and the step, caused by it."""
    error = info.value
    assert type(error) is PostLoadError and isinstance(error.__cause__, Injected)
    assert error.step == " ".join(site) and error.layer == layer.layer_name
    assert str(error).startswith(f"vllm-mla: absorbed-pair materialization of {layer.layer_name}")
    assert f"failed at {error.step} (Injected: {error.step})" in str(error)


@pytest.mark.parametrize("backend", [None, SPARSE])
def test_a_fault_at_every_step_leaves_the_layer_as_it_was(registered, variant, built, backend):
    kwargs = {"backend": backend, "dense_prefill": backend is None}
    probe = built(**kwargs)
    sites = _sites(lambda: vllm_layers.post_load(probe, torch.bfloat16))
    aliased = variant.dtype == torch.bfloat16 and variant.method == "unquantized" and not backend
    assert aliased or {kind for kind, _ in sites} >= {"alloc", "dequant", "copy"}
    assert not backend or aliased or "release" in {kind for kind, _ in sites}
    for i in range(len(sites)):
        layer = built(**kwargs)
        before = vllm_layers.snapshot(layer)
        with faults.inject(_fail_at(i)), pytest.raises(PostLoadError) as info, torch.no_grad():
            vllm_layers.post_load(layer, torch.bfloat16)
        _assert_one_clear_error(info, layer, sites[i])
        assert vllm_layers.same_as(layer, before) == [], f"fault at {sites[i]}"
        with torch.no_grad():
            vllm_layers.post_load(layer, torch.bfloat16)  # the retry succeeds
        for ours, theirs in zip(pair(layer), pair(upstream(built)), strict=True):
            assert torch.equal(ours, theirs), f"retry after a fault at {sites[i]}"
        FAULT_SITES.record(variant.id, "post-load" if backend is None else "post-load, release")


def _reloading(build):
    """A layer served from seed 0 whose kv_b_proj now holds seed 5, copied in place as vLLM's
    reload does (``_copy_and_restore_kernel_tensors``, ``reuse_packed_weight_storage``),
    about to run post-load again."""
    layer = build()  # an upstream backend: the source stays, reload refills in place
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16)
    fresh = build(seed=5).kv_b_proj
    new = vllm_layers.layer_tensors(mla_layer(fresh))
    with torch.no_grad():
        for name, tensor in vllm_layers.layer_tensors(layer).items():
            if name.startswith("kv_b.") and tensor.numel():
                tensor.copy_(new[name])
    if fresh in vllm_layers._GEMM_WEIGHT:
        vllm_layers._GEMM_WEIGHT[layer.kv_b_proj] = vllm_layers._GEMM_WEIGHT[fresh]
    return layer


def _retry_succeeds_in_place(layer, addresses: list[int], want, site) -> None:
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16)
    assert [t.data_ptr() for t in pair(layer)] == addresses, f"retry after a fault at {site}"
    for ours, theirs in zip(pair(layer), want, strict=True):
        assert torch.equal(ours, theirs), f"retry after a fault at {site}"


def test_a_fault_during_reload_keeps_the_live_pair(registered, variant, built):
    """A reload that fails part-way leaves the old pair (addresses and values) serving,
    the new source in place, and the retry succeeds in place. (After a release, vLLM's
    reload itself is faulted: ``test_a_fault_in_vllms_reload_of_a_released_layer``.)"""
    probe = _reloading(built)
    sites = _sites(lambda: vllm_layers.post_load(probe, torch.bfloat16))
    assert ("copy", "commit W_UK_T") in sites or variant.method == "unquantized"
    want = pair(upstream(built, seed=5))
    for i in range(len(sites)):
        layer = _reloading(built)
        addresses = [t.data_ptr() for t in pair(layer)]
        before = vllm_layers.snapshot(layer)
        with faults.inject(_fail_at(i)), pytest.raises(PostLoadError) as info, torch.no_grad():
            vllm_layers.post_load(layer, torch.bfloat16)
        _assert_one_clear_error(info, layer, sites[i])
        assert vllm_layers.same_as(layer, before) == [], f"fault at {sites[i]}"
        _retry_succeeds_in_place(layer, addresses, want, sites[i])
        FAULT_SITES.record(variant.id, "reload")


def _fault_in_real_reload(variant, index: int | None):
    """vLLM's layerwise reload of seed 5 into a B12X_MLA_SPARSE layer (source released) with
    a fault at post-load site ``index`` (None: only list the sites). Returns (layer, sites,
    snapshot taken as the post-load began, pair addresses before the reload, error)."""
    model = vllm_layers.build_model(variant, 0, backend=SPARSE, dense_prefill=False)
    layer = model.attn
    with torch.no_grad():
        vllm_layers.post_load(layer, torch.bfloat16)
    addresses = [t.data_ptr() for t in pair(layer)]
    taken, sites, error = {}, [], None
    patched = type(layer).process_weights_after_loading

    def post_load_watched(*act_dtype):  # (act_dtype) in vLLM 0.32 / 0.33, () in 0.34
        taken["before"] = vllm_layers.snapshot(layer)
        return patched(layer, *act_dtype)

    layer.process_weights_after_loading = post_load_watched  # vLLM's finalize calls it

    def injector(kind, name):
        sites.append((kind, name))
        if len(sites) == (index or 0) + 1 and index is not None:
            raise Injected(f"{kind} {name}")

    try:
        with faults.inject(injector):
            vllm_layers.reload_through_vllm(model, variant, seed=5)
    except PostLoadError as exc:
        error = exc
    del layer.process_weights_after_loading
    return layer, sites, taken.get("before"), addresses, error


def test_a_fault_in_vllms_reload_of_a_released_layer(registered, variant, built):
    """The sparse backend released kv_b_proj; vLLM's own reload brings a new source back
    and ends with post-load: a fault at each of its steps leaves every tensor as the
    reload left it, one PostLoadError names it, and post-load then succeeds in place."""
    _, sites, _, _, error = _fault_in_real_reload(variant, None)
    assert error is None and sites
    want = pair(upstream(built, seed=5))
    for i in range(len(sites)):
        layer, seen, before, addresses, error = _fault_in_real_reload(variant, i)
        assert error is not None, f"no error for a fault at {sites[i]}"
        assert seen[-1] == sites[i] and error.step == " ".join(sites[i])
        assert isinstance(error.__cause__, Injected) and error.layer == layer.layer_name
        assert vllm_layers.same_as(layer, before) == [], f"fault at {sites[i]}"
        _retry_succeeds_in_place(layer, addresses, want, sites[i])
        FAULT_SITES.record(variant.id, "vLLM reload, released")


def test_every_row_of_the_matrix_has_a_real_variant(variant):
    """Every row is built for real here, or (only) its kernel's package is absent from this
    environment and the other vLLM environment builds it."""
    names = {v.form for v in vllm_layers.VARIANTS}
    assert names == {f.name for f in FORMS}
    for v in vllm_layers.VARIANTS:
        assert v in VARIANTS or v.missing() is not None
    cls = variant.kernel_class()
    if cls is not None:
        assert cls.__name__ in forms.form(variant.form).kernels


def test_stand_in_targets_exist_in_the_installed_vllm(variant):
    """Drift in any name a stand-in or the matrix relies on fails here."""
    import importlib

    cls = variant.kernel_class()
    if cls is None:
        return
    source = inspect.getsource(cls.process_weights_after_loading)
    expect = {
        "fp8-block-deepgemm": ["deepgemm_post_process_fp8_weight_block", "replace_parameter"],
        "fp8-block-deepgemm-packed": ["deepgemm_post_process_fp8_weight_block"],
        "mxfp8-b12x": ["b12x_mxfp8_packed_weight", "new_empty((0,))"],
        "mxfp8-flashinfer": ["weight_scale"],
        "mxfp8-emulation": ["dequant_mxfp8_to_bf16"],
    }.get(variant.form, [])
    for needle in expect:
        assert needle in source, f"{cls.__name__}.process_weights_after_loading: no {needle!r}"
    names = {
        "deepgemm-sm90": [
            (
                "vllm.model_executor.layers.quantization.utils.fp8_utils",
                "transform_sf_into_required_layout",
            ),
            (
                "vllm.model_executor.layers.quantization.utils.fp8_utils",
                "requant_weight_ue8m0_inplace",
            ),
        ],
        "marlin-repack": [("vllm._custom_ops", "gptq_marlin_repack")],
        "b12x": [("b12x.gemm.blockscaled._linear", "_check_gpu_tensor")],
        "trtllm": [("flashinfer", "shuffle_matrix_sf_a")],
    }
    for group in variant.stand_ins:
        for module, attr in names.get(group, []):
            assert hasattr(importlib.import_module(module), attr), f"{module}.{attr}"
    if variant.form == "mxfp8-b12x":
        warmup = inspect.getsource(cls.get_b12x_warmup_unit)
        assert "packed_weight.weight.values" in warmup and "in_features" in warmup


def test_qualify_default_names_the_vllm_method(variant):
    if variant.form != "mxfp8-flashinfer":
        return
    report = run_qualify(QualifyConfig(layers=1))
    assert report["weights"] == "mxfp8-flashinfer"
    assert "FlashInfer CUTLASS" in report["form"]["vllm"]
    assert "ModelOptLinearMethod" in report["form"]["vllm"]


def test_variant_is_the_kernel_vllm_selects(variant, built):
    kv_b = built().kv_b_proj
    assert forms.kernel_name(kv_b) == (variant.kernel_class().__name__ if variant.kernel else None)
    assert isinstance(variant, Variant)
