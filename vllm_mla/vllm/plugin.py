"""vLLM general plugin: ``vllm.general_plugins`` entry point ``vllm_mla``.

vLLM calls ``register()`` in every process (front end, engine core, each TP
worker), possibly several times; it imports vLLM lazily, applies the features
chosen by ``VLLM_MLA`` / ``VLLM_MLA_FEATURES`` once, and logs one line.
"""

from __future__ import annotations

import logging

from vllm_mla import envs

logger = logging.getLogger("vllm_mla")
_result: dict[str, str] | None = None


def register() -> dict[str, str]:
    """Apply the enabled patches (idempotent); returns {feature: outcome}."""
    global _result
    if _result is not None:
        return _result
    if not envs.plugin_enabled():
        _result = {}
        logger.info("vllm-mla: disabled by VLLM_MLA=0; vLLM untouched")
        return _result
    from vllm_mla.vllm import patches

    features, unknown = envs.plugin_features()
    _result = patches.apply(features)
    for name in unknown:
        _result[name] = f"skipped: unknown feature (known: {', '.join(envs.FEATURES)})"
    summary = "; ".join(f"{k}: {v}" for k, v in sorted(_result.items())) or "no features"
    logger.info("vllm-mla %s: %s", patches.vllm_version(), summary)
    return _result


def reset() -> None:
    """Forget the registration and revert every patch (tests)."""
    global _result
    from vllm_mla.vllm import patches

    patches.revert()
    _result = None
