"""Sparse MLA (absorbed / MQA form) over top-k physical KV rows: the whole op, no vLLM.

Modules: ``formats`` (cache records, constants, errors), ``validate`` (the argument
contract), ``reference`` (torch), ``triton_kernels`` (split-K kernels, split plan,
scratch sizing), ``api`` (``sparse_mla_forward``, scratch sizing, prewarm), ``dispatch``
(the one implementation choice and run), ``custom_op`` (the op torch sees),
``b12x_runner`` (b12x's SM12x kernels behind the same contract), ``record_write`` (the
cache write, with its Triton nvfp4_ds_mla writer in ``record_write_kernel``; the codec in
``nvfp4_record``), ``preparation``
(plan -> prepare -> bind -> run -> release, the bound decode call), ``selection``
(top-k buffer ownership, logical -> physical rows). The vLLM backend is
``vllm_mla.vllm.sparse``.


Contract: ``q [T, H, 576]`` (or ``(q_nope [T, H, 512], q_pe [T, H, 64])``, any strides
with a contiguous last dim), bf16 or fp32; ``kv_cache [num_blocks, block_size, record]``
in ``fp8_ds_mla``, ``bf16`` or ``nvfp4_ds_mla`` (kv_format), addressed by strides;
``indices [T, K]`` int32 physical rows, -1 empty, entries at ``j >= lengths[t]`` ignored.
``score = softmax_scale * (q_nope . kv_c + q_pe . k_pe)``,
``out = softmax(score) @ kv_c`` ``[T, H, 512]`` in q's dtype, ``lse`` natural-log fp32;
a row with no valid index gives out 0, lse -inf. Optional ``sink`` (fp32 ``[H]``,
natural-log, unscaled: HY-V4's learnable attention sink): ``e^{sink[h]}`` joins each
denominator, ``out = sum_j e^{x_j} v_j / (sum_j e^{x_j} + e^{sink[h]})`` and the lse
includes it (a row with no valid index: out 0, lse ``sink[h]``). fp32 accumulation
everywhere; Triton vs reference within ``OUT_REL_ERR`` / ``LSE_ABS_ERR``.
"""

from vllm_mla.ops.sparse_mla.api import (
    LSE_ABS_ERR,
    OUT_REL_ERR,
    compiled_variants,
    prewarm,
    scratch_bytes,
    sparse_mla_forward,
)
from vllm_mla.ops.sparse_mla.dispatch import IMPLS, register_b12x_runner, select_impl
from vllm_mla.ops.sparse_mla.formats import (
    FP8_DS_MLA_RECORD,
    HEAD_DIM,
    KV_FORMATS,
    LATENT,
    ROPE,
    SparseMLAError,
    SparseMLANotPrepared,
    SparseMLATypeError,
    pack_bf16,
    pack_fp8_ds_mla,
    pack_rows,
    record_bytes,
    record_width,
    unpack_rows,
)
from vllm_mla.ops.sparse_mla.preparation import (
    PlanReleased,
    PreparationError,
    PreparationFrozen,
    PreparationSession,
    ProbeRetained,
    SparseMLABinding,
    SparseMLACaps,
    SparseMLAPlan,
    plan,
)
from vllm_mla.ops.sparse_mla.record_write import write_records, write_records_reference
from vllm_mla.ops.sparse_mla.reference import sparse_mla_reference
from vllm_mla.ops.sparse_mla.selection import (
    SelectionUnavailable,
    TopkSelection,
    logical_to_physical,
)

__all__ = [
    "FP8_DS_MLA_RECORD",
    "HEAD_DIM",
    "IMPLS",
    "KV_FORMATS",
    "LATENT",
    "LSE_ABS_ERR",
    "OUT_REL_ERR",
    "ROPE",
    "PlanReleased",
    "PreparationError",
    "PreparationFrozen",
    "PreparationSession",
    "ProbeRetained",
    "SelectionUnavailable",
    "SparseMLABinding",
    "SparseMLACaps",
    "SparseMLAError",
    "SparseMLANotPrepared",
    "SparseMLAPlan",
    "SparseMLATypeError",
    "TopkSelection",
    "compiled_variants",
    "logical_to_physical",
    "pack_bf16",
    "pack_fp8_ds_mla",
    "pack_rows",
    "plan",
    "prewarm",
    "record_bytes",
    "record_width",
    "register_b12x_runner",
    "scratch_bytes",
    "select_impl",
    "sparse_mla_forward",
    "sparse_mla_reference",
    "unpack_rows",
    "write_records",
    "write_records_reference",
]
