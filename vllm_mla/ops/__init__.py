"""Decode path ops: the safe query BMM, the absorbed-weight BMM (dense or MXFP8 views) with
its routed weight type, and the fused query projection."""

from vllm_mla.ops.absorbed_matmul import AbsorbedBmmError, absorbed_bmm, mla_v_projection
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.ops.base import KernelNotPrewarmed, MXFP8Weight
from vllm_mla.ops.query_bmm import cuda_op_available, safe_mla_query_bmm
from vllm_mla.ops.query_projection import (
    QueryProjectionNotPrewarmed,
    can_fuse_query_projection,
    mla_query_projection,
    prewarm_query_projection,
    staged_query_projection,
)

__all__ = [
    "AbsorbedBmmError",
    "AbsorbedWeight",
    "KernelNotPrewarmed",
    "MXFP8Weight",
    "QueryProjectionNotPrewarmed",
    "absorbed_bmm",
    "can_fuse_query_projection",
    "cuda_op_available",
    "mla_query_projection",
    "mla_v_projection",
    "prewarm_query_projection",
    "safe_mla_query_bmm",
    "staged_query_projection",
]
