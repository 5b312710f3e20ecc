"""The absorbed-weight BMM ``out[b] = a[b] @ W[b]`` (W dense or an MXFP8 view of a pack).

Modules: ``api`` (``absorbed_bmm``, ``mla_v_projection``, the contract and its checks),
``reference`` (torch), ``kernel`` (Triton kernel and launch), ``dispatch`` (the path and its
run), ``custom_op`` (the ops torch sees). The routed weight type is ``ops.absorbed_weight``.
"""

from vllm_mla.ops.absorbed_matmul import custom_op as _custom_op  # noqa: F401  (registers)
from vllm_mla.ops.absorbed_matmul.api import (
    ACT_DTYPES,
    MXFP8_ACT_DTYPES,
    SCALE_DTYPES,
    AbsorbedBmmError,
    MXFP8Weight,
    absorbed_bmm,
    mla_v_projection,
    parts,
    scales_along_k,
    validate,
)
from vllm_mla.ops.absorbed_matmul.dispatch import calls, new_out, plan_path, reset_calls, run
from vllm_mla.ops.absorbed_matmul.reference import absorbed_bmm_reference, decode

__all__ = [
    "ACT_DTYPES",
    "MXFP8_ACT_DTYPES",
    "SCALE_DTYPES",
    "AbsorbedBmmError",
    "MXFP8Weight",
    "absorbed_bmm",
    "absorbed_bmm_reference",
    "calls",
    "decode",
    "mla_v_projection",
    "new_out",
    "parts",
    "plan_path",
    "reset_calls",
    "run",
    "scales_along_k",
    "validate",
]
