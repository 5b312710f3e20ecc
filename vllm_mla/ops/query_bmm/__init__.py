"""``safe_mla_query_bmm``: the decode query BMM that never reads outside its views.

Modules: ``api`` (the contract and ``safe_mla_query_bmm``), ``reference`` (torch),
``kernel`` (the compiled CUDA op, csrc/query_bmm.cu), ``custom_op`` (the op, its dispatch
keys and fake). The C++ library names ``custom_op`` as the fake impl's home (torch
imports it to find the fake).
"""

from vllm_mla.ops.query_bmm import custom_op as _custom_op  # noqa: F401  (registers)
from vllm_mla.ops.query_bmm.api import safe_mla_query_bmm
from vllm_mla.ops.query_bmm.kernel import SCHEMA, cuda_op_available, cuda_op_error

__all__ = ["SCHEMA", "cuda_op_available", "cuda_op_error", "safe_mla_query_bmm"]
