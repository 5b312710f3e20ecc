"""Patch the DSA indexer's query quantization for CPU tensors.

Target: ``vllm.model_executor.models.deepseek_v2.per_token_group_quant_fp8(x, group_size,
eps, dtype, column_major_scales, tma_aligned_scales, out_q, use_ue8m0)`` (the name the
generic DeepSeek model's ``Indexer.forward`` calls; vLLM 0.32, 0.33), feature
``sparse-cpu``, CPU platform only.
Why: off CUDA/XPU it falls back to a Triton kernel, and vLLM CPU runs without Triton
(``triton.next_power_of_2`` raises before any launch).
How: CPU tensors are quantized by ``vllm_mla.ops.sparse_indexer.quantize_rows`` (per group
of ``group_size``: ``max(amax, eps) / 448``, a power of two with ``use_ue8m0``, the same
rule); every other tensor, and column-major or TMA-aligned scale requests, go to the
original untouched.
Removal: when vLLM ships a CPU ``per_token_group_fp8_quant``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_mla.ops.sparse_indexer import quantize_rows


def make_per_token_group_quant_fp8(original: Callable) -> Callable:
    """The replacement for ``deepseek_v2.per_token_group_quant_fp8``."""

    def per_token_group_quant_fp8(
        x,
        group_size,
        eps=1e-10,
        dtype=None,
        column_major_scales=False,
        tma_aligned_scales=False,
        out_q=None,
        use_ue8m0=None,
    ):
        plain = not (column_major_scales or tma_aligned_scales) and out_q is None
        wanted = dtype in (None, torch.float8_e4m3fn)
        if x.device.type != "cpu" or not plain or not wanted or x.shape[-1] % group_size:
            return original(
                x,
                group_size,
                eps,
                dtype,
                column_major_scales,
                tma_aligned_scales,
                out_q,
                use_ue8m0,
            )
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
        values, scales = quantize_rows(groups, ue8m0=bool(use_ue8m0), floor=eps)
        return values.reshape(x.shape), scales

    return per_token_group_quant_fp8
