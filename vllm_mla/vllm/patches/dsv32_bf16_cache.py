"""Patch ``DeepseekV32ForCausalLM.verify_and_update_config``: keep an explicit bf16 cache.

Target: ``vllm.model_executor.models.config.DeepseekV32ForCausalLM
.verify_and_update_config(cls, vllm_config)`` (a classmethod; vLLM 0.32, 0.33), feature
``sparse``.
Why: it turns ``--kv-cache-dtype bfloat16`` into ``auto`` for every DSA checkpoint. For
B12X_MLA_SPARSE ``auto`` is the model dtype, so a bf16 request becomes an fp32 cache on
an fp32 model (CPU) instead of the bf16 records the user asked for.
How: the original runs unchanged; with B12X_MLA_SPARSE selected, a ``bfloat16`` request
is put back. Every other backend keeps upstream's remap.
Removal: when upstream keeps an explicit ``bfloat16`` cache dtype.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.vllm.sparse.registration import selects_ours


def make_verify_and_update_config(original: Callable) -> Callable:
    """The replacement for ``DeepseekV32ForCausalLM.verify_and_update_config``."""

    def verify_and_update_config(cls, vllm_config) -> None:
        cache = vllm_config.cache_config
        asked = cache.cache_dtype
        original(cls, vllm_config)
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        if asked == "bfloat16" and selects_ours(backend):
            cache.cache_dtype = "bfloat16"

    return verify_and_update_config
