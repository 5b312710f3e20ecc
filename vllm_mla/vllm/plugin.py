"""vLLM general plugin: ``vllm.general_plugins`` entry point ``vllm_mla``.

vLLM calls ``register()`` in every process (front end, engine core, each TP
worker), possibly several times; it imports vLLM lazily, applies the features
chosen by ``VLLM_MLA`` / ``VLLM_MLA_FEATURES`` once, and logs one short line (which
features applied, which were skipped) plus, at DEBUG (``VLLM_LOGGING_LEVEL=DEBUG``), one
line per feature saying exactly what it patched or registered.
"""

from __future__ import annotations

import logging

from vllm_mla import envs

logger = logging.getLogger("vllm_mla")
_result: dict[str, str] | None = None


def _make_visible() -> None:
    """vLLM configures only its own ``vllm`` logger; without a handler of ours (or the
    application's, on the root logger) the start-up line at INFO would be dropped."""
    if logger.level == logging.NOTSET:
        level = envs.logging_level()
        logger.setLevel(level if level in logging.getLevelNamesMapping() else logging.INFO)
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [vllm-mla] %(message)s"))
    logger.addHandler(handler)


def _cuda_indexer() -> str:
    """Feature ``sparse-indexer``: the portable DSA indexer on CUDA (VLLM_MLA_INDEXER)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "skipped: for cuda only (on CPU feature sparse-cpu serves the indexer)"
    from vllm_mla.vllm.sparse import indexer, kpool_indexer

    return "; ".join((indexer.register("cuda"), kpool_indexer.register_on_import("cuda")))


def register() -> dict[str, str]:
    """Apply the enabled patches (idempotent); returns {feature: outcome}."""
    global _result
    if _result is not None:
        return _result
    _make_visible()
    if not envs.plugin_enabled():
        _result = {}
        logger.info("vllm-mla: disabled by VLLM_MLA=0; vLLM untouched")
        return _result
    from vllm_mla.vllm import patches

    features, unknown = envs.plugin_features()
    # opt-in: without VLLM_MLA_TP_PAD=1 vLLM keeps refusing TP sizes that do not divide
    off = features & ({"tp-pad"} if not envs.tp_pad() else set())
    _result = patches.apply(features - off)
    _result.update(dict.fromkeys(off, "skipped: off (VLLM_MLA_TP_PAD=1 turns it on)"))
    if _result.get("sparse", "").startswith("applied"):
        from vllm_mla.vllm.sparse import registration

        _result["sparse"] += "; " + registration.register()
    if _result.get("sparse-cpu", "").startswith("applied"):
        from vllm_mla.vllm.sparse import cpu

        _result["sparse-cpu"] += "; " + cpu.register()
    if _result.get("query", "").startswith("applied"):
        from vllm_mla.vllm import fused_query

        _result["query"] += "; " + fused_query.register()
    if _result.get("sparse-indexer", "").startswith("applied"):
        _result["sparse-indexer"] = _cuda_indexer()
    if "cpu-mxfp8" in _result:
        from vllm_mla.vllm import cpu_mxfp8

        _result["cpu-mxfp8"] = cpu_mxfp8.register()
    for name in unknown:
        _result[name] = f"skipped: unknown feature (known: {', '.join(envs.FEATURES)})"
    logger.info("vllm-mla %s: %s", patches.vllm_version(), summary(_result))
    for name, outcome in sorted(_result.items()):
        logger.debug("vllm-mla: %s: %s", name, outcome)
    return _result


def summary(result: dict[str, str]) -> str:
    """One short line: the features applied, then those skipped with their first reason."""
    applied = [k for k, v in result.items() if not v.startswith(("skipped", "failed"))]
    others = [
        f"{k} ({v.removeprefix('skipped: ').split(';')[0].split(' (')[0]})"
        for k, v in result.items()
        if k not in applied
    ]
    line = f"applied {', '.join(sorted(applied)) or 'nothing'}"
    if others:
        line += f"; not applied: {', '.join(sorted(others))}"
    if "sparse" in applied:
        line += "; sparse backend: --attention-backend B12X_MLA_SPARSE"
    return line + " (one line per feature at VLLM_LOGGING_LEVEL=DEBUG)"


def reset() -> None:
    """Forget the registration and revert every patch (tests)."""
    global _result
    from vllm_mla.vllm import patches

    patches.revert()
    from vllm_mla.vllm import on_import

    on_import.cancel()  # registrations still waiting for a model's import (kpool indexer)
    from vllm_mla.vllm.wake_check import STATE

    STATE.reset()
    from vllm_mla.vllm import fused_query

    fused_query.unregister()
    try:
        from vllm_mla.vllm.sparse import registration

        registration.unregister_custom()
    except ImportError:  # vLLM not importable: nothing was registered
        pass
    _result = None


def registered() -> dict[str, str] | None:
    """What ``register()`` applied in this process (None: it has not run here)."""
    return None if _result is None else dict(_result)
