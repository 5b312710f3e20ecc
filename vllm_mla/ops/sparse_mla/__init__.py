"""Sparse MLA (absorbed / MQA form) over top-k physical KV rows.

Contract: ``q [T, H, 576]`` (or ``(q_nope [T, H, 512], q_pe [T, H, 64])``, any strides
with a contiguous last dim), bf16 or fp32; ``kv_cache [num_blocks, block_size, record]``
in ``fp8_ds_mla`` or ``bf16`` (kv_format), addressed by strides; ``indices [T, K]``
int32 physical rows, -1 empty, entries at ``j >= lengths[t]`` ignored.
``score = softmax_scale * (q_nope . kv_c + q_pe . k_pe)``,
``out = softmax(score) @ kv_c`` ``[T, H, 512]`` in q's dtype, ``lse`` natural-log fp32;
a row with no valid index gives out 0, lse -inf. fp32 accumulation everywhere;
Triton vs reference within ``OUT_REL_ERR`` / ``LSE_ABS_ERR``.
"""

from vllm_mla.ops.sparse_mla.dispatch import (
    IMPLS,
    LSE_ABS_ERR,
    OUT_REL_ERR,
    compiled_variants,
    prewarm,
    register_b12x_runner,
    scratch_bytes,
    select_impl,
    sparse_mla_forward,
)
from vllm_mla.ops.sparse_mla.kv_format import (
    KV_FORMATS,
    SparseMLAError,
    SparseMLANotPrepared,
    SparseMLATypeError,
    pack_bf16,
    pack_fp8_ds_mla,
    pack_rows,
    record_bytes,
    unpack_rows,
)
from vllm_mla.ops.sparse_mla.reference import sparse_mla_reference

__all__ = [
    "IMPLS",
    "KV_FORMATS",
    "LSE_ABS_ERR",
    "OUT_REL_ERR",
    "SparseMLAError",
    "SparseMLANotPrepared",
    "SparseMLATypeError",
    "compiled_variants",
    "pack_bf16",
    "pack_fp8_ds_mla",
    "pack_rows",
    "prewarm",
    "record_bytes",
    "register_b12x_runner",
    "scratch_bytes",
    "select_impl",
    "sparse_mla_forward",
    "sparse_mla_reference",
    "unpack_rows",
]
