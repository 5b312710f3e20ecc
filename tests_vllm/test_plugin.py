"""The plugin and its patch registry against the installed vLLM."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
import vllm
from vllm.model_executor.layers.attention import mla_attention

from vllm_mla.vllm import patches, plugin

STOCK = mla_attention.MLAAttention.process_weights_after_loading


def current():
    return mla_attention.MLAAttention.process_weights_after_loading


def test_installed_vllm_is_supported():
    assert patches.supported(vllm.__version__)


_SINK_UPSTREAM = "not needed: its sink has a weight loader (make_attention_sink)"
_SINKS_UPSTREAM = f"hyv4_sink_reload {_SINK_UPSTREAM}; dsv4_sink_reload {_SINK_UPSTREAM}"
_ON_IMPORT = {"hyv4": "vllm.models.hy_v4.nvidia.model", "dsv4": "vllm.models.deepseek_v4.cpu.model"}


@pytest.fixture
def sink_when() -> dict[str, str]:
    """What the line says of each on-import sink patch: applied at once where an earlier
    test already imported its module, deferred otherwise (read before ``registered``
    runs, which itself may import it)."""
    return {
        key: "" if module in sys.modules else f" (when {module} is imported)"
        for key, module in _ON_IMPORT.items()
    }


LIFECYCLE = {  # what the lifecycle feature applies, per vLLM version ({hyv4}, {dsv4}: sink_when)
    "0.32": "applied MLAAttention.process_weights_after_loading, "
    "_copy_and_restore_kernel_tensors, HYV4Model.load_weights{hyv4}, "
    "DeepseekV4Model.load_weights{dsv4}, finalize_layerwise_processing",
    "0.33": "applied MLAAttention.process_weights_after_loading, "
    f"_copy_and_restore_kernel_tensors, finalize_layerwise_processing; {_SINKS_UPSTREAM}",
    "0.34": "applied MLAAttention.process_weights_after_loading, "
    f"_copy_and_restore_kernel_tensors; {_SINKS_UPSTREAM}; glm5next_reload not "
    "needed: the indexer refills _wp_fp32 in its process_weights_after_loading and the KDA "
    "convolutions are one fused parameter",
}


def test_register_patches_the_lifecycle_target(sink_when, registered):
    assert registered["sparse"].startswith("applied _canonicalize_sparse_mla_kv_cache_dtype")
    assert registered["sparse-cpu"].startswith(  # this environment's platform is the CPU
        "applied CpuPlatform.get_attn_backend_cls, CpuPlatform.check_and_update_config"
    )
    assert {k: v for k, v in registered.items() if not k.startswith("sparse")} == {
        "lifecycle": LIFECYCLE[patches.installed_minor()].format(**sink_when),
        "lifecycle-cpu": "applied UnquantizedFusedMoEMethod._setup_kernel",
        "query": "applied MLAAttention._v_up_proj; fused query projection "
        "(_DecodeConcatQuantFP8.register_oot, forward_mqa wrap; VLLM_MLA_QUERY=auto)",
        "cpu-mxfp8": "registered EmulationMxfp8LinearKernel for CPU (register_linear_kernel)",
        "wake-check": "applied Worker.sleep, Worker.wake_up, Worker.execute_model",
        "tp-pad": "skipped: off (VLLM_MLA_TP_PAD=1 turns it on)",  # opt-in
        "dsv4-gpu": "skipped: for cuda only (platform cpu)",  # CPU here
    }
    assert registered["sparse-indexer"].startswith("skipped: for cuda only")  # CPU here
    assert current() is not STOCK and current().__wrapped__ is STOCK


def test_tp_pad_applies_only_when_turned_on(monkeypatch):
    from vllm.config.model import ModelConfig

    stock = ModelConfig.verify_with_parallel_config
    plugin.reset()
    monkeypatch.setenv("VLLM_MLA_TP_PAD", "1")
    try:
        assert plugin.register()["tp-pad"] == (
            "applied ModelConfig.verify_with_parallel_config, "
            "DefaultModelLoader.get_all_weights, pad_vocab_size"
        )
        assert ModelConfig.verify_with_parallel_config.__wrapped__ is stock
    finally:
        plugin.reset()
    assert ModelConfig.verify_with_parallel_config is stock


def test_cpu_mxfp8_makes_vllm_select_a_kernel_on_cpu(registered):
    from vllm.model_executor.kernels.linear import init_mxfp8_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel

    kernel = init_mxfp8_linear_kernel(weight_shape=(256, 512))
    assert type(kernel) is EmulationMxfp8LinearKernel


def test_without_cpu_mxfp8_vllm_cpu_has_no_mxfp8_kernel(monkeypatch):
    import vllm.model_executor.kernels.linear as linear
    from vllm.platforms import PlatformEnum

    monkeypatch.setitem(linear._POSSIBLE_MXFP8_KERNELS, PlatformEnum.CPU, [])
    with pytest.raises(ValueError, match="Failed to find a kernel"):
        linear.init_mxfp8_linear_kernel(weight_shape=(256, 512))


def test_register_twice_patches_once(registered):
    first = current()
    plugin._result = None  # as if a second process-level call came in fresh
    assert plugin.register() == registered
    assert current() is first and current().__wrapped__ is STOCK


def test_disabled_by_env_leaves_vllm_untouched(monkeypatch):
    monkeypatch.setenv("VLLM_MLA", "0")
    plugin.reset()
    assert plugin.register() == {}
    assert current() is STOCK


def test_feature_selection(monkeypatch):
    monkeypatch.setenv("VLLM_MLA_FEATURES", "query,bogus")
    plugin.reset()
    result = plugin.register()
    assert current() is STOCK and "unknown feature" in result["bogus"]
    assert set(result) == {"query", "bogus"}
    assert hasattr(mla_attention.MLAAttention._v_up_proj, patches.MARK)


def test_renamed_target_skips_the_feature_with_a_warning(monkeypatch, caplog):
    renamed = dataclasses.replace(patches.PATCHES[0], qualname="MLAAttention.renamed_post_load")
    monkeypatch.setattr(patches, "PATCHES", (renamed,))
    plugin.reset()
    with caplog.at_level(logging.WARNING, logger="vllm_mla"):
        result = plugin.register()
    assert result["lifecycle"].startswith("skipped:") and "renamed_post_load" in caplog.text
    assert current() is STOCK


def test_changed_signature_skips_the_feature(monkeypatch):
    other = dataclasses.replace(
        patches.PATCHES[0], params=("self", "act_dtype", "extra"), params_at=()
    )
    monkeypatch.setattr(patches, "PATCHES", (other, *patches.PATCHES[1:]))
    plugin.reset()
    assert "expected parameters" in plugin.register()["lifecycle"]
    assert current() is STOCK


def test_missing_helper_skips_the_feature(monkeypatch):
    other = dataclasses.replace(patches.PATCHES[0], requires=("no_such_helper",))
    monkeypatch.setattr(patches, "PATCHES", (other,))
    plugin.reset()
    assert "no_such_helper" in plugin.register()["lifecycle"]
    assert current() is STOCK


def test_patch_not_written_for_this_version_skips_the_feature(monkeypatch):
    old = dataclasses.replace(patches.PATCHES[1], versions=("0.31",))
    monkeypatch.setattr(patches, "PATCHES", (patches.PATCHES[0], old))
    plugin.reset()
    assert "not written for vLLM" in plugin.register()["lifecycle"]
    assert current() is STOCK


def test_a_feature_applies_all_or_none(monkeypatch):
    good = patches.PATCHES[0]
    bad = dataclasses.replace(good, name="other", qualname="MLAAttention.missing")
    monkeypatch.setattr(patches, "PATCHES", (good, bad))
    plugin.reset()
    assert plugin.register()["lifecycle"].startswith("skipped:")
    assert current() is STOCK


def test_unsupported_vllm_applies_nothing_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(patches, "_warned_version", False)
    with caplog.at_level(logging.WARNING, logger="vllm_mla"):
        first = patches.apply(frozenset({"lifecycle"}))
        patches.apply(frozenset({"lifecycle"}))
    assert first == {"lifecycle": "skipped: vLLM 0.99.0 unsupported"}
    assert caplog.text.count("not one of") == 1 and current() is STOCK


def test_a_platform_bound_feature_is_skipped_elsewhere(monkeypatch):
    monkeypatch.setattr(patches, "_platform", lambda: "cuda")
    result = patches.apply(frozenset({"sparse-cpu"}))
    assert result == {"sparse-cpu": "skipped: for cpu only (platform cuda)"}
    from vllm.platforms import cpu

    assert not hasattr(cpu.CpuPlatform.get_attn_backend_cls, patches.MARK)


def test_classmethod_targets_stay_classmethods_and_revert(registered):
    import inspect

    from vllm.platforms import cpu

    patched = inspect.getattr_static(cpu.CpuPlatform, "get_attn_backend_cls")
    assert isinstance(patched, classmethod) and hasattr(patched.__func__, patches.MARK)
    plugin.reset()
    stock = inspect.getattr_static(cpu.CpuPlatform, "get_attn_backend_cls")
    assert isinstance(stock, classmethod) and not hasattr(stock.__func__, patches.MARK)


def _words(text: str) -> str:
    """Prose compared as words: no backticks, whitespace collapsed, no final period."""
    return " ".join(text.replace("``", "").split()).rstrip(".")


def _registry_entries() -> dict[str, dict[str, str]]:
    """The registry docstring's entries: {name: {"head", "target", "why", "removal"}}."""
    entries = {}
    for block in patches.__doc__.split("\n\n")[1:]:
        lines = block.strip().splitlines()
        if not lines or not lines[0].startswith("``"):
            continue
        name = lines[0].split("``")[1]
        fields, key = {"head": lines[0]}, None
        for line in lines[1:]:
            label = line.strip().split(":", 1)[0]
            if label in ("versions", "target", "why", "how", "removal"):
                key, line = label, line.split(":", 1)[1]
            fields[key] = fields.get(key, "") + " " + line
        entries[name] = {k: _words(v) for k, v in fields.items()}
        entries[name]["target"] = entries[name]["target"].replace(" ", "")  # one dotted name
    return entries


def _module_doc(name: str) -> dict[str, str]:
    """A patch module's docstring fields: lines ``Target:``, ``Why:``, ``How:``,
    ``Removal:``, each running to the next label or blank line."""
    folder = Path(patches.__file__).parent
    doc = (folder / f"{name}.py").read_text().split('"""')[1]
    fields, key = {}, None
    for line in doc.splitlines():
        label = line.split(":", 1)[0]
        if label in ("Target", "Why", "How", "Removal"):
            key, line = label, line.split(":", 1)[1]
        elif not line.strip():
            key = None
        if key is not None:
            fields[key] = fields.get(key, "") + " " + line
    return {k: _words(v) for k, v in fields.items()}


def test_registry_modules_docs_and_targets_agree():
    """One ``Patch`` per module file; its registry docstring entry names the same feature,
    target and removal condition; the module's own docstring the same target and removal;
    its factory lives in that module; the target exists in the installed vLLM."""
    folder = Path(patches.__file__).parent
    files = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert files == {p.name for p in patches.PATCHES}
    entries = _registry_entries()
    assert set(entries) == files
    for patch in patches.PATCHES:
        entry, own = entries[patch.name], _module_doc(patch.name)
        target = f"{patch.module}.{patch.qualname}"
        head = entry["head"].replace("``", "")
        assert f"(feature {patch.feature}," in head or f"(feature {patch.feature})" in head
        assert entry["versions"] == _words(patch.versions_text()), patch.name
        assert entry["target"] == target, patch.name
        assert entry["removal"] == _words(patch.removal), patch.name
        assert set(own) == {"Target", "Why", "How", "Removal"}, patch.name
        assert own["Target"].replace(" ", "").startswith(target), patch.name
        assert own["Removal"] == _words(patch.removal), patch.name
        assert patch.factory.startswith(f"vllm_mla.vllm.patches.{patch.name}:"), patch.name
        if patch.upstream_in(patches.installed_minor()) is None:
            patches.resolve(patch)  # target exists with the expected parameters


def test_entry_point_is_declared():
    import tomllib

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {
        "vllm_mla": "vllm_mla.vllm.plugin:register"
    }


def test_start_up_log_is_one_short_line_and_details_at_debug(monkeypatch, caplog):
    monkeypatch.delenv("VLLM_MLA_FEATURES", raising=False)
    plugin.reset()
    with caplog.at_level(logging.DEBUG, logger="vllm_mla"):
        result = plugin.register()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    (line,) = [m for m in info if m.startswith("vllm-mla ")]
    assert len(line) < 300, line
    applied = sorted(k for k, v in result.items() if not v.startswith("skipped"))
    assert f"applied {', '.join(applied)};" in line
    assert "not applied: dsv4-gpu (for cuda only), sparse-indexer (for cuda only)" in line
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    for name, outcome in result.items():  # every feature's whole outcome, once
        assert debug.count(f"vllm-mla: {name}: {outcome}") == 1
    assert plugin.summary({"query": "skipped: x; y"}) == (
        "applied nothing; not applied: query (x) (one line per feature at VLLM_LOGGING_LEVEL=DEBUG)"
    )


def test_a_patch_vllm_does_itself_is_not_applied_and_its_feature_is(monkeypatch):
    """``upstream_at``: in that version the patch is left out, said why, and the rest of
    its feature applies (as mtp_draft_backend on vLLM 0.34)."""
    from vllm.model_executor.model_loader.reload import layerwise

    minor = patches.installed_minor()
    native = dataclasses.replace(
        patches.PATCHES[1], versions=(), upstream_at=((minor, "vLLM does it itself"),)
    )
    monkeypatch.setattr(patches, "PATCHES", (patches.PATCHES[0], native))
    plugin.reset()
    outcome = plugin.register()["lifecycle"]
    assert outcome.startswith("applied") and current() is not STOCK
    assert f"{native.name} not needed: vLLM does it itself" in outcome
    assert not hasattr(layerwise._copy_and_restore_kernel_tensors, patches.MARK)
    assert dict(patches.check_targets()["lifecycle"])[native.name].startswith("not needed")


def test_check_vllm_names_the_target_that_moved(monkeypatch, capsys):
    from vllm_mla.tools import cli

    assert cli.main(["check-vllm"]) == 0  # every target of the installed vLLM in place
    moved = dataclasses.replace(patches.PATCHES[0], qualname="MLAAttention.gone", params_at=())
    monkeypatch.setattr(patches, "PATCHES", (moved, *patches.PATCHES[1:]))
    outcome = dict(patches.check_targets()["lifecycle"])[moved.name]
    assert outcome.startswith("moved:") and "MLAAttention.gone" in outcome
    capsys.readouterr()
    assert cli.main(["check-vllm"]) == 1
    printed = capsys.readouterr().out
    assert "lifecycle: would NOT apply" in printed and "MLAAttention.gone" in printed


def test_check_vllm_judges_an_unknown_version_by_the_newest_targets(monkeypatch, capsys):
    """The version gate applies nothing to an unknown release; the check still says what
    would have to move, against the newest supported version's signatures."""
    from vllm_mla.tools import cli

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    cli.main(["check-vllm"])
    printed = capsys.readouterr().out
    assert "0.99.0: not one of" in printed
    assert f"judged against {patches.SUPPORTED_VLLM[-1]}'s targets" in printed
