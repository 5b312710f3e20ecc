"""Patch vLLM 0.34's nvfp4_ds_mla + DCP refusal so B12X_MLA_SPARSE can serve the seeds'
deployment (nvfp4_ds_mla records at DCP 4).

Target: ``vllm.config.vllm.VllmConfig.validate_nvfp4_kv_cache_with_mla(self)`` (a pydantic
``model_validator(mode="after")``; vLLM 0.34, absent from 0.32 and 0.33), feature
``sparse``. Pydantic calls the function its compiled schema captured, so the registry
also rebinds the validator in the class's decorator table and rebuilds the schema
(``Patch.pydantic_validator``).
Why: it refuses ``nvfp4_ds_mla`` with ``decode_context_parallel_size > 1`` for every
backend, because "the chunked-context prefill gather is not validated under DCP": that
gather is FLASHMLA_SPARSE's dense prefill path. B12X_MLA_SPARSE has no such path (every
token goes through ``forward_mqa``), and its DCP reads nvfp4 records as it reads the
others (tests_e2e: TP 2 / DCP 2 / MTP 3 and TP 4 / DCP 4 / MTP 3 give TP 1's tokens).
How: with B12X_MLA_SPARSE selected and an ``nvfp4_ds_mla`` cache the config is accepted
(the rest of the original only concerns the plain ``nvfp4`` layout); every other config
goes to the original, which refuses as before.
Removal: when upstream scopes the refusal to the backends with that prefill gather.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.vllm.sparse.registration import selects_ours

FORMAT = "nvfp4_ds_mla"


def make_validate(original: Callable) -> Callable:
    """The replacement for ``VllmConfig.validate_nvfp4_kv_cache_with_mla``."""

    def validate_nvfp4_kv_cache_with_mla(self):
        backend = getattr(getattr(self, "attention_config", None), "backend", None)
        if self.cache_config.cache_dtype == FORMAT and selects_ours(backend):
            return self
        return original(self)

    return validate_nvfp4_kv_cache_with_mla
