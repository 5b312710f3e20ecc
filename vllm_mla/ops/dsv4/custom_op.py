"""DeepSeek-V4's ops as torch.compile and CUDA graphs see them: ``vllm_mla::dsv4_attend``
(mutates ``out``) and ``vllm_mla::dsv4_write_records`` (mutates ``cache``), each the
``dispatch`` function of the same name behind it. The fakes allocate nothing."""

from __future__ import annotations

import torch

from vllm_mla.ops.dsv4 import dispatch


@torch.library.custom_op("vllm_mla::dsv4_attend", mutates_args=("out",))
def dsv4_attend_op(
    q: torch.Tensor,
    window_cache: torch.Tensor,
    window_slots: torch.Tensor,
    window_block_size: int,
    compressed_cache: torch.Tensor | None,
    compressed_slots: torch.Tensor | None,
    compressed_block_size: int,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    impl: str = "auto",
) -> None:
    # checked at every call: under torch.compile a wrapper's checks run at trace time only
    dispatch.attend(
        q, window_cache, window_slots, window_block_size, compressed_cache, compressed_slots,
        compressed_block_size, sink, scale, out=out, impl=impl,
    )  # fmt: skip


@dsv4_attend_op.register_fake
def _(q, wc, ws, wb, cc, cs, cb, sink, scale, out, impl="auto"):
    return None


@torch.library.custom_op("vllm_mla::dsv4_write_records", mutates_args=("cache",))
def dsv4_write_records_op(
    cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    writer: str = "cpu",
    impl: str = "auto",
) -> None:
    dispatch.write(cache, rows, slots, block_size, writer, impl)


@dsv4_write_records_op.register_fake
def _(cache, rows, slots, block_size, writer="cpu", impl="auto"):
    return None
