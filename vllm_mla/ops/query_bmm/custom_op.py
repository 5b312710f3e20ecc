"""``torch.ops.vllm_mla.safe_mla_query_bmm`` on every machine, and its one dispatcher: the
op's dispatch keys. CUDA: the compiled kernel when ``vllm_mla._C`` loaded, else ``torch.bmm``
(on SM12x on a contiguous copy of the query, logged once); CPU: ``torch.bmm``. The fake
impl lets torch.compile(fullgraph=True) and CUDA-graph capture trace it.
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_mla.ops.query_bmm import kernel
from vllm_mla.ops.query_bmm.reference import bmm_into

logger = logging.getLogger("vllm_mla")
_QUALNAME = f"{kernel.NAMESPACE}::{kernel.NAME}"
_lib = torch.library.Library(kernel.NAMESPACE, "FRAGMENT")  # keeps the registrations alive


@functools.cache
def _is_sm12x(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 12


@functools.cache
def _log_copy_path_once() -> None:
    logger.warning(
        "safe_mla_query_bmm: the CUDA op is not built (%s); on SM12x it runs torch.bmm on a "
        "contiguous copy of the query (safe, one extra copy per call)",
        kernel.cuda_op_error(),
    )


def _cuda_fallback(query: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    if _is_sm12x(query.device.index):
        _log_copy_path_once()
        # cuBLAS on SM12x over-reads strided operands; contiguous ones are safe.
        query, weight = query.contiguous(), weight.contiguous()
    bmm_into(query, weight, out)


if not kernel.cuda_op_available():
    _lib.define(kernel.SCHEMA)
    _lib.impl(kernel.NAME, _cuda_fallback, "CUDA")
_lib.impl(kernel.NAME, bmm_into, "CPU")


@torch.library.register_fake(_QUALNAME, lib=_lib)
def _fake(query: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    return None  # mutates out in place; no new tensor
