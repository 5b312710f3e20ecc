"""How the plugin wires GLM-5.3-Flash's path on vLLM CPU without costing other models: the
import hook (``vllm_mla.vllm.on_import``), the ``on_import`` patch of the indexer's
constructor, the kpool indexer registered on import, and the vLLM CPU gaps the tiny
checkpoint steps around (``vllm_mla.tools.tiny_glm5next``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllm_mla.vllm import on_import, patches
from vllm_mla.vllm.patches import PATCHES
from vllm_mla.vllm.patches.cpu_glm5next_indexer_weights import make_init
from vllm_mla.vllm.sparse import kpool_indexer


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A throwaway package ``hooked_pkg`` with a module ``model`` defining ``VALUE``."""
    root = tmp_path / "hooked_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "model.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "hooked_pkg.model"
    on_import.cancel()
    for name in ("hooked_pkg.model", "hooked_pkg"):
        sys.modules.pop(name, None)


def test_a_callback_runs_after_the_module_executes_and_only_once(package):
    seen = []
    assert not on_import.when_imported(package, lambda m: seen.append(m.VALUE))
    assert package not in sys.modules and on_import.pending() == {package: 1}
    __import__(package)
    assert seen == [41] and on_import.pending() == {}
    sys.modules.pop(package)
    __import__(package)  # a second import of the module does not run it again
    assert seen == [41]


def test_a_module_already_imported_runs_the_callback_at_once(package):
    __import__(package)
    seen = []
    assert on_import.when_imported(package, lambda m: seen.append(m.VALUE))
    assert seen == [41] and on_import.pending() == {}


def test_cancel_drops_the_waiting_callbacks_and_the_hook(package):
    on_import.when_imported(package, lambda m: pytest.fail("cancelled"))
    on_import.cancel()
    __import__(package)
    assert on_import.pending() == {} and not any(
        type(f).__module__ == on_import.__name__ for f in sys.meta_path
    )


def test_cancelling_some_modules_keeps_the_others_waiting(package):
    """The patch registry's ``revert`` cancels its own pending patches only; a registration
    waiting for another module (the kpool indexer's) stays until the plugin's ``reset``."""
    seen = []
    on_import.when_imported(package, lambda m: seen.append(m.VALUE))
    on_import.when_imported("hooked_pkg.other", lambda m: pytest.fail("cancelled"))
    on_import.cancel({"hooked_pkg.other"})
    patches.revert()
    assert on_import.pending() == {package: 1}
    __import__(package)
    assert seen == [41]


def test_the_indexer_patch_keeps_the_projection_weight():
    """vLLM CPU's post-load replaces a linear weight with an empty placeholder unless
    ``_cpu_skip_gemm_dispatch``; the indexer reads ``wk_weights_proj.weight`` later."""

    class Indexer:
        def __init__(self, width):
            self.wk_weights_proj = torch.nn.Linear(width, 2)

    Indexer.__init__ = make_init(Indexer.__init__)
    assert Indexer(4).wk_weights_proj._cpu_skip_gemm_dispatch is True
    (patch,) = [p for p in PATCHES if p.name == "cpu_glm5next_indexer_weights"]
    assert patch.on_import and patch.platforms == ("cpu",)


WIRING = textwrap.dedent(
    """
    import sys
    from vllm_mla.vllm import on_import, plugin
    result = plugin.register()
    if not result.get("sparse-cpu", "").startswith("applied"):
        print("SKIP", result.get("sparse-cpu")); raise SystemExit(0)
    assert not any(m.startswith("vllm.models.glm5next") for m in sys.modules)
    glm = {m for m in on_import.pending() if m.startswith("vllm.models.glm5next")}
    assert glm == {
        "vllm.models.glm5next.common.attention",
        "vllm.models.glm5next.common.kda",
        "vllm.models.glm5next.common.model",
        "vllm.models.glm5next.nvidia.sparse_indexer",
    }, on_import.pending()
    import vllm.models.glm5next  # what resolving Glm5NextForCausalLM does
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.models.glm5next.common.attention import Indexer
    assert op_registry_oot["SparseAttnIndexerKpool"].__qualname__ == "CLASS_NAME"
    assert getattr(Indexer.__init__, "__vllm_mla_patch__") == "cpu_glm5next_indexer_weights"
    from vllm.models.glm5next.common import kda
    for name, patch in (
        ("chunk_kda_with_fused_gate", "cpu_glm5next_kda_chunk"),
        ("fused_recurrent_kda", "cpu_glm5next_kda_recurrent"),
        ("gather_initial_states", "cpu_glm5next_kda_gather"),
        ("scatter_states", "cpu_glm5next_kda_scatter"),
    ):
        assert getattr(getattr(kda, name), "__vllm_mla_patch__") == patch, name
    from vllm.models.glm5next.common.model import Glm5NextDecoderLayer as Layer
    for name in ("pre", "fused_post_pre", "post"):
        method = getattr(Layer, "hc_" + name)
        assert getattr(method, "__vllm_mla_patch__") == "cpu_glm5next_mhc_" + name
    assert not any(m.startswith("vllm.models.glm5next") for m in on_import.pending())
    print("OK")
    """
).replace("CLASS_NAME", kpool_indexer.CLASS_NAME)


def test_glm5next_work_waits_for_the_model_and_then_is_all_in_place():
    """In a fresh process (the plugin's features on vLLM CPU): nothing of GLM-5.3-Flash is
    imported at registration; importing the model package registers the kpool indexer and
    patches the indexer's constructor, the four kernels its KDA layers call and the decoder
    layer's three mHC blocks."""
    pytest.importorskip("vllm.models.glm5next")
    result = subprocess.run(
        [sys.executable, "-c", WIRING],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if result.stdout.startswith("SKIP"):
        pytest.skip(f"feature sparse-cpu not applied here: {result.stdout.strip()}")
    assert "OK" in result.stdout


# -- the vLLM CPU gaps the tiny GLM-5.3-Flash checkpoint steps around ------------------------
def test_vllms_cpu_mhc_pre_ignores_the_layer_norm_weight():
    """vLLM's mHC pre block receives the decoder layer's input RMSNorm weight
    (``norm_weight``) and on CPU drops it: its torch path (``forward_native``, what
    ``forward_cpu``'s fused op computes) returns the same layer input whatever the weight
    and takes bf16 only. An mHC checkpoint would be another model on vLLM CPU; the patches
    ``cpu_glm5next_mhc_*`` apply the norm after the torch path. When this fails vLLM
    applies the weight itself and those patches must go (they would normalize twice)."""
    mhc = pytest.importorskip("vllm.model_executor.layers.mhc")
    hc, d = 4, 64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, hc, d, generator=gen).bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * d, generator=gen) * 0.02
    scale, base = torch.ones(3), torch.zeros((2 + hc) * hc)
    op = mhc.MHCPreOp.__new__(mhc.MHCPreOp)  # forward_native needs no CustomOp state
    outs = [
        op.forward_native(x, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20, 1, w, 1e-6)[2]
        for w in (torch.ones(d), torch.full((d,), 3.0))
    ]
    assert torch.equal(*outs)
    with pytest.raises(AssertionError):
        op.forward_native(x.float(), fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
