"""B12X_MLA_SPARSE core (no vLLM import): preparation, KV-pool binding, top-k selection.

The vLLM glue lives in ``vllm_mla.vllm.sparse``; the kernels in ``vllm_mla.ops.sparse_mla``.
"""

from vllm_mla.backends.b12x_sparse.kv_binding import (
    CacheWriterFormat,
    KVPoolReleased,
    LayerKVBinding,
    flat_rows,
    pool_identity,
    storage_alias,
)
from vllm_mla.backends.b12x_sparse.preparation import (
    FP8_DS_MLA_RECORD,
    HEAD_SIZE,
    KV_FORMATS,
    LATENT,
    ROPE,
    PlanReleased,
    PreparationError,
    PreparationFrozen,
    PreparationSession,
    ProbeRetained,
    SparseMLABinding,
    SparseMLACaps,
    SparseMLANotPrepared,
    SparseMLAPlan,
    plan,
    record_width,
)
from vllm_mla.backends.b12x_sparse.selection import (
    SelectionUnavailable,
    TopkSelection,
    logical_to_physical,
)

__all__ = [
    "FP8_DS_MLA_RECORD",
    "HEAD_SIZE",
    "KV_FORMATS",
    "LATENT",
    "ROPE",
    "CacheWriterFormat",
    "KVPoolReleased",
    "LayerKVBinding",
    "PlanReleased",
    "PreparationError",
    "PreparationFrozen",
    "PreparationSession",
    "ProbeRetained",
    "SelectionUnavailable",
    "SparseMLABinding",
    "SparseMLACaps",
    "SparseMLANotPrepared",
    "SparseMLAPlan",
    "TopkSelection",
    "flat_rows",
    "logical_to_physical",
    "plan",
    "pool_identity",
    "record_width",
    "storage_alias",
]
