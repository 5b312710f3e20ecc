"""The kv_b_proj matrix in the core: detection, readers, release and faults for every row.

The vLLM classes themselves are exercised in ``tests_vllm/test_kv_b_forms.py``; here the
rows are vllm-mla's own stand-in layers (``weights.standins``), plus modules carrying vLLM's
class *names* to check detection rules without vLLM.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_mla.quant import fp8_block
from vllm_mla.tools.standins import build_layer, source_tensors, synthetic_weight
from vllm_mla.weights import LifecycleConfig, PostLoadError, faults, forms, post_load
from vllm_mla.weights.forms import FORM_NAMES, FORMS
from vllm_mla.weights.sources import module_tensors

RELEASE = LifecycleConfig(release_source=True, dense_mha_prefill=False)


def layer_of(geo, name, seed=0):
    return build_layer(geo, source_tensors(synthetic_weight(geo, seed=seed, layer=0), name))


def named(cls_name: str, **attrs) -> object:
    return type(cls_name, (), {})() if not attrs else type(cls_name, (), attrs)()


def vllm_like_fp8(kernel: str, rows=512, cols=256, block=(128, 128)) -> nn.Module:
    """A module shaped like vLLM's block-FP8 ColumnParallelLinear: bias registered as None."""
    q = fp8_block.quantize(torch.randn(rows, cols) * 0.05)
    module = nn.Module()
    module.register_parameter("weight", nn.Parameter(q.values, requires_grad=False))
    module.register_parameter("weight_scale_inv", nn.Parameter(q.scale_inv, requires_grad=False))
    module.register_parameter("bias", None)
    module.output_size_per_partition, module.input_size_per_partition = rows, cols
    module.weight_block_size = list(block)
    module.quant_method = named("Fp8LinearMethod")
    module.quant_method.fp8_linear = named(kernel)
    return module


def test_rows_are_unique_and_named():
    assert len(FORM_NAMES) == len(set(FORM_NAMES)) == len(FORMS)
    for f in FORMS:
        assert f.family in ("unquantized", "fp8-block", "mxfp8")
        assert (f.family == "unquantized") == (not f.kernels)
        assert f.selected and f.tensors


def test_a_none_bias_is_no_tensor():
    """vLLM registers bias=None: the source is the real tensors only (the crash class)."""
    module = vllm_like_fp8("CutlassFp8BlockScaledMMKernel")
    found, why = forms.detect(module)
    assert found is not None and found.name == "fp8-block", why
    source = forms.source_of(found, module)
    assert source.names == ("weight", "weight_scale_inv")
    assert "bias" not in module_tensors(module)


@pytest.mark.parametrize(
    ("kernel", "form"),
    [
        ("CutlassFp8BlockScaledMMKernel", "fp8-block"),
        ("DeepGemmFp8BlockScaledMMKernel", "fp8-block-deepgemm"),
        ("MarlinFP8ScaledMMLinearKernel", "fp8-block-marlin"),
    ],
)
def test_block_fp8_is_detected_by_its_kernel(kernel, form):
    module = vllm_like_fp8(kernel)
    if form == "fp8-block-marlin":  # Marlin's layout: only its GEMM reads it
        module.weight.data = torch.zeros(256 // 16, 4 * 512, dtype=torch.int32)
    assert forms.detect(module)[0].name == form


def test_unknown_forms_are_named_not_guessed():
    module = vllm_like_fp8("SomeNewFp8Kernel")
    found, why = forms.detect(module)
    assert found is None and "Fp8LinearMethod + SomeNewFp8Kernel" in why
    module = vllm_like_fp8("CutlassFp8BlockScaledMMKernel", block=(1, 128))
    assert forms.detect(module)[0] is None  # per-channel blocks are not this row
    module = vllm_like_fp8("CutlassFp8BlockScaledMMKernel")
    module.weight_scale_inv.data = module.weight_scale_inv.data[:, :1]
    found, why = forms.detect(module)
    assert found is None and "kv_b_proj.weight_scale_inv: expected float32 (4, 2)" in why


@pytest.mark.parametrize("name", FORM_NAMES)
def test_every_row_reads_back_the_checkpoint(geo, name):
    """Chunked reads (any chunking) equal one whole read, and every row decodes to the same
    weight as the plain checkpoint of its family (DeepGEMM's requantized values aside)."""
    layer = layer_of(geo, name)
    source = forms.read_source(layer.kv_b_proj)
    rows, cols = source.shape
    whole = source.reader.read(0, rows if source.reader.axis == "rows" else cols)
    step = 7
    total = rows if source.reader.axis == "rows" else cols
    parts = torch.cat([source.reader.read(a, min(a + step, total)) for a in range(0, total, step)])
    assert torch.equal(parts, whole)
    if source.reader.axis == "cols":
        whole = whole.T
    family = forms.form(name).family
    plain = "fp8-block" if family == "fp8-block" else ("mxfp8" if family == "mxfp8" else name)
    if "deepgemm" not in name:
        ref = forms.read_source(layer_of(geo, plain).kv_b_proj).reader.read(0, rows)
        assert torch.equal(whole.to(torch.bfloat16), ref.to(torch.bfloat16))


@pytest.mark.parametrize("name", FORM_NAMES)
def test_every_row_releases_every_source_tensor(geo, name):
    layer = layer_of(geo, name)
    post_load(layer, torch.bfloat16, RELEASE)
    assert all(t.numel() == 0 for t in module_tensors(layer.kv_b_proj).values())
    assert all(getattr(layer.kv_b_proj, a, None) is None for a in forms.PACKED_ATTRS)
    assert forms.read_source(layer.kv_b_proj) is None
    assert post_load(layer, torch.bfloat16, RELEASE).action == "noop"


def everything(layer) -> dict[str, tuple]:
    kv_b = layer.kv_b_proj
    tensors = {f"attn.{n}": t for n, t in module_tensors(layer).items()}
    tensors.update((f"kv_b.{n}", t) for n, t in module_tensors(kv_b).items())
    for attr in forms.PACKED_ATTRS:
        owner = getattr(kv_b, attr, None)
        tensors[f"kv_b.{attr}"] = owner
    return {
        n: (id(t), None if t is None else (t.data_ptr(), t.detach().clone()))
        if isinstance(t, torch.Tensor) or t is None
        else (id(t), None)
        for n, t in tensors.items()
    }


def unchanged(layer, before) -> bool:
    now = everything(layer)
    if now.keys() != before.keys():
        return False
    for name, (ident, data) in before.items():
        got_ident, got_data = now[name]
        if got_ident != ident:
            return False
        if data is not None and (
            got_data[0] != data[0]
            or not torch.equal(
                got_data[1].reshape(-1).view(torch.uint8), data[1].reshape(-1).view(torch.uint8)
            )
        ):
            return False
    return True


class Injected(RuntimeError):
    pass


@pytest.mark.parametrize("name", FORM_NAMES)
@pytest.mark.parametrize("config", [LifecycleConfig(), RELEASE], ids=["keep", "release"])
def test_a_fault_at_every_site_changes_nothing(geo, name, config):
    sites = []
    probe = layer_of(geo, name)
    with faults.inject(lambda kind, site: sites.append((kind, site))):
        post_load(probe, torch.bfloat16, config)
    for i in range(len(sites)):
        layer = layer_of(geo, name)
        before = everything(layer)

        def fail(kind, site, i=i, count=[0]):  # noqa: B006 (a fresh counter per site index)
            count[0] += 1
            if count[0] == i + 1:
                raise Injected(f"{kind} {site}")

        with faults.inject(fail), pytest.raises(PostLoadError) as info:
            post_load(layer, torch.bfloat16, config)
        assert isinstance(info.value.__cause__, Injected)
        assert info.value.step == " ".join(sites[i]), "the error names the step that failed"
        assert unchanged(layer, before), f"{name}: fault at {sites[i]}"
        assert post_load(layer, torch.bfloat16, config).action in ("materialized", "aliased")


def test_the_seam_remembers_the_last_step_reached_since_begin():
    faults.begin()
    assert faults.last_step() is None
    faults.site("alloc", "W_UV")
    faults.site("dequant", "rows 0:2")
    assert faults.last_step() == "dequant rows 0:2"
    faults.begin()
    assert faults.last_step() is None


def test_a_real_error_names_its_step(geo, monkeypatch):
    """Not only injected faults: an allocator failure inside post-load is a PostLoadError
    naming the allocation it hit, with the original as its cause."""
    layer = layer_of(geo, "fp8-block")
    real_empty = torch.empty
    calls = [0]

    def empty(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(PostLoadError) as info:
        post_load(layer, torch.bfloat16, RELEASE)
    monkeypatch.undo()
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert info.value.step == "alloc W_UV"
    assert "failed at alloc W_UV (OutOfMemoryError: CUDA out of memory." in str(info.value)
    assert post_load(layer, torch.bfloat16, RELEASE).action == "materialized"


def test_post_load_errors_survive_pickling():
    """vLLM sends a worker's exception to the engine process pickled."""
    import pickle

    error = PostLoadError("what", "kept", "alloc W_UV", "Boom: x", "model.layers.0.attn")
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) and again.layer == "model.layers.0.attn"


def test_the_seam_costs_nothing_when_unused_and_refuses_nesting():
    assert faults._injector is None
    faults.site("alloc", "anything")  # no injector: a no-op
    with (
        faults.inject(lambda k, n: None),
        pytest.raises(RuntimeError, match="already"),
        faults.inject(lambda k, n: None),
    ):
        pass
    assert faults._injector is None


def test_the_docs_show_the_matrix_the_code_dispatches_on():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "absorbed-weights.md").read_text()
    begin = readme.index("<!-- kv_b_proj matrix: begin")
    shown = readme[readme.index("\n", begin) + 1 : readme.index("<!-- kv_b_proj matrix: end")]
    assert shown.strip() == forms.matrix_markdown()
