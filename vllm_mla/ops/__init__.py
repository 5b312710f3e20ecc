"""Decode query path: the safe query BMM and the fused query projection."""

from vllm_mla.ops.query_bmm import cuda_op_available, safe_mla_query_bmm
from vllm_mla.ops.query_projection import (
    MXFP8Weight,
    QueryProjectionNotPrewarmed,
    can_fuse_query_projection,
    mla_query_projection,
    prewarm,
    staged_query_projection,
)

__all__ = [
    "MXFP8Weight",
    "QueryProjectionNotPrewarmed",
    "can_fuse_query_projection",
    "cuda_op_available",
    "mla_query_projection",
    "prewarm",
    "safe_mla_query_bmm",
    "staged_query_projection",
]
