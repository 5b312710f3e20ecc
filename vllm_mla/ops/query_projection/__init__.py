"""The MLA decode query projection ``[q_nope @ W_UK_T | q_pe]`` (BF16 or FP8), fused.

Modules: ``api`` (the contract, ``mla_query_projection``, the gate, prewarm),
``reference`` (the staged path), ``kernel`` (Triton kernel and launch), ``dispatch``
(fused or staged), ``custom_op`` (the op torch sees). Deferral of vLLM's W_UK_T bmm into
this op: ``ops.query_fusion``.
"""

from vllm_mla.ops.query_projection import custom_op as _custom_op  # noqa: F401  (registers)
from vllm_mla.ops.query_projection.api import (
    FUSED_HEADS,
    FUSED_LATENT,
    FUSED_MAX_M,
    FUSED_NOPE,
    FUSED_ROPE,
    OUT_DTYPES,
    Args,
    QueryProjectionNotPrewarmed,
    can_fuse_query_projection,
    mla_query_projection,
    prewarm_query_projection,
    validate,
)
from vllm_mla.ops.query_projection.reference import staged_query_projection

__all__ = [
    "FUSED_HEADS",
    "FUSED_LATENT",
    "FUSED_MAX_M",
    "FUSED_NOPE",
    "FUSED_ROPE",
    "OUT_DTYPES",
    "Args",
    "QueryProjectionNotPrewarmed",
    "can_fuse_query_projection",
    "mla_query_projection",
    "prewarm_query_projection",
    "staged_query_projection",
    "validate",
]
