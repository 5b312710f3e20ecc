"""The sparse-MLA ops torch.compile and CUDA graphs see: ``vllm_mla::sparse_mla_forward``
and ``vllm_mla::write_kv_records`` (``record_write``; mutates ``kv_cache``).

``sparse_mla_forward`` mutates ``out``, ``lse``, ``scratch`` and ``invalid``; reads
``sink`` (``Tensor?``, last, default None: the schema without a sink is a prefix of this
one). The fake impls allocate nothing.
"""

from __future__ import annotations

import torch

from vllm_mla.ops.sparse_mla import dispatch, record_write
from vllm_mla.ops.sparse_mla.validate import validate


@torch.library.custom_op(
    "vllm_mla::sparse_mla_forward", mutates_args=("out", "lse", "scratch", "invalid")
)
def sparse_mla_forward_op(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scratch: torch.Tensor | None,
    invalid: torch.Tensor | None,
    softmax_scale: float,
    kv_format: str,
    impl: str,
    sink: torch.Tensor | None = None,
) -> None:
    # Validated again on purpose: under torch.compile the wrapper's checks run at trace
    # time only, and this op is what runs at every call (the decode step uses neither:
    # it goes through preparation.BoundCall).
    validate(
        (q_nope, q_pe),
        kv_cache,
        indices,
        kv_format=kv_format,
        lengths=lengths,
        out=out,
        lse=lse,
        invalid=invalid,
        sink=sink,
    )
    dispatch.run(
        dispatch.resolve(impl, q_nope.device),
        q_nope,
        q_pe,
        kv_cache,
        indices,
        out,
        softmax_scale=softmax_scale,
        kv_format=kv_format,
        lengths=lengths,
        lse=lse,
        scratch=scratch,
        invalid=invalid,
        sink=sink,
    )


@sparse_mla_forward_op.register_fake
def _(
    q_nope,
    q_pe,
    kv_cache,
    indices,
    lengths,
    out,
    lse,
    scratch,
    invalid,
    scale,
    fmt,
    impl,
    sink=None,
):
    return None


@torch.library.custom_op("vllm_mla::write_kv_records", mutates_args=("kv_cache",))
def write_kv_records_op(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_format: str,
    impl: str,
) -> None:
    # checked by record_write.write_records, which resolved ``impl`` for this device
    record_write.run(impl, kv_c, k_pe, kv_cache, slot_mapping, kv_format)


@write_kv_records_op.register_fake
def _(kv_c, k_pe, kv_cache, slot_mapping, kv_format, impl):
    return None
