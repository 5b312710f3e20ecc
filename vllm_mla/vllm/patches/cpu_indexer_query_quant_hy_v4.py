"""Patch HY-V4's indexer query quantization for CPU tensors.

Target: ``vllm.models.hy_v4.nvidia.attention.per_token_group_quant_fp8(x, group_size,
eps, dtype, column_major_scales, tma_aligned_scales, out_q, use_ue8m0)`` (the name HY-V4's
own ``Indexer.forward`` calls: imported by HY-V4 itself, so the ``deepseek_v2`` name that
``cpu_indexer_query_quant`` patches does not reach it; vLLM 0.32, 0.33), feature
``sparse-cpu``, CPU platform only.
Why: off CUDA/XPU it falls back to a Triton kernel, and vLLM CPU runs without Triton
(``triton.next_power_of_2`` raises before any launch).
How: the replacement of ``cpu_indexer_query_quant`` (the same function object is patched
under HY-V4's name): CPU tensors through ``vllm_mla.ops.sparse_indexer.quantize_rows``,
everything else to the original untouched.
Removal: when vLLM ships a CPU ``per_token_group_fp8_quant``.
"""

from __future__ import annotations

from vllm_mla.vllm.patches.cpu_indexer_query_quant import make_per_token_group_quant_fp8

__all__ = ["make_per_token_group_quant_fp8"]
