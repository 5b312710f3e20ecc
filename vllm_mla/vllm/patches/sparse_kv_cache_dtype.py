"""Patch ``_canonicalize_sparse_mla_kv_cache_dtype`` so B12X_MLA_SPARSE gets fp8_ds_mla.

Target: ``vllm.model_executor.layers.attention.mla_attention
._canonicalize_sparse_mla_kv_cache_dtype(attn_backend, kv_cache_dtype)`` (vLLM 0.33).
Why: upstream maps ``fp8`` to ``fp8_ds_mla`` only for its own sparse backends
(FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE_SM120), matched by name; for any other backend
``fp8`` stays plain fp8, a layout the sparse kernels do not read.
How: for a backend named ``B12X_MLA_SPARSE`` (also when registered as CUSTOM: the
name comes from the class), the quantized requests ``fp8`` and ``fp8_e4m3`` become
``fp8_ds_mla`` (the KV-format table's ``requested_as``), as upstream does for
FLASHMLA_SPARSE; ``auto`` stays ``auto`` (the model dtype: bf16 records for a bf16 model),
``bfloat16`` stays bf16 (with the ``dsv32_bf16_cache`` patch, which keeps vLLM from
turning it into ``auto``) and ``nvfp4_ds_mla`` reaches the original, which keeps it for
any backend but FLASHMLA_SPARSE. Every other backend and dtype goes to the original
untouched.
Removal: when upstream canonicalises by a backend attribute instead of by name.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.formats import SPARSE_BACKEND
from vllm_mla.ops.sparse_mla.formats import FORMAT_OF_REQUEST

BACKEND = SPARSE_BACKEND
CANONICAL = FORMAT_OF_REQUEST  # request -> record format, from the KV-format table


def make_canonicalize(original: Callable) -> Callable:
    """The replacement for ``_canonicalize_sparse_mla_kv_cache_dtype``."""

    def _canonicalize_sparse_mla_kv_cache_dtype(attn_backend, kv_cache_dtype):
        if attn_backend.get_name() == BACKEND and kv_cache_dtype in CANONICAL:
            return CANONICAL[kv_cache_dtype]
        return original(attn_backend, kv_cache_dtype)

    _canonicalize_sparse_mla_kv_cache_dtype.__doc__ = original.__doc__
    return _canonicalize_sparse_mla_kv_cache_dtype
