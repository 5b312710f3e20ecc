"""Lean metadata builder for ``B12X_MLA_SPARSE``.

Subclasses ``AttentionMetadataBuilder`` directly (not ``SparseMLACommonMetadataBuilder``)
so that it allocates no chunked-prefill workspace (~72 MiB) and no top-k mask
workspace: every token goes through ``forward_mqa``, so ``prefill`` is always None.
It owns int32 buffers: ``max_num_batched_tokens`` token -> request indices, and, only
where the device's kernel takes physical rows (b12x, the reference),
``[max_num_batched_tokens, topk]`` physical rows (topk: the model's top-k buffer
width, ``served.topk_buffer_width``) (each layer converts its logical top-k
into it right before its kernel, so no step allocates them; the Triton kernel maps
logical rows itself, so that 4 x tokens x topk-byte buffer is not allocated), and calls
``_init_reorder_batch_threshold`` so vLLM reorders batches decode-first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonMetadata
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from vllm_mla.formats import ROPE
from vllm_mla.ops.sparse_mla import select_impl
from vllm_mla.ops.sparse_mla.formats import FORMAT_OF_CACHE_DTYPE
from vllm_mla.vllm.sparse.impl import serving_impl
from vllm_mla.vllm.sparse.served import model_has_sink, topk_buffer_width

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import AttentionSpec


@dataclass(kw_only=True)
class B12XMLASparseMetadata(SparseMLACommonMetadata):
    """``SparseMLACommonMetadata`` with ``prefill`` always None (MQA-only), plus the
    builder-owned ``[max_tokens, topk]`` int32 buffer each layer converts its top-k into."""

    physical_indices: torch.Tensor | None = None


class B12XMLASparseMetadataBuilder(AttentionMetadataBuilder[B12XMLASparseMetadata]):
    """Decode-first, MQA-only metadata; no generic prefill or mask workspace."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        hf = vllm_config.model_config.hf_text_config
        # the model's top-k buffer width (a kpool model's is wider than index_topk)
        self.topk_tokens: int = topk_buffer_width(hf)
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.req_id_per_token_buffer = torch.empty((max_tokens,), dtype=torch.int32, device=device)
        self.physical_indices_buffer: torch.Tensor | None = None
        dcp = vllm_config.parallel_config.decode_context_parallel_size
        rope = getattr(hf, "qk_rope_head_dim", None)
        rope = rope if isinstance(rope, int) else ROPE
        # the layers' choice; a spec without a dtype string is taken as b12x-readable, so
        # the physical-row buffer exists whenever the layers may plan b12x
        dtype = getattr(kv_cache_spec, "cache_dtype_str", None) or ""
        fmt = FORMAT_OF_CACHE_DTYPE.get(dtype, "fp8_ds_mla")
        impl = serving_impl(select_impl(device), dcp, model_has_sink(hf), rope, fmt)
        if impl != "triton":  # the plan takes physical rows
            self.physical_indices_buffer = torch.empty(
                (max_tokens, self.topk_tokens), dtype=torch.int32, device=device
            )
        # Decode-first order: short queries (and spec-decode drafts) form the front of
        # the batch; without this call vLLM does not reorder for this builder.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> B12XMLASparseMetadata:
        cam = common_attn_metadata
        req_id_per_token = token_to_request(cam, self.req_id_per_token_buffer)
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold or 1
        )
        return B12XMLASparseMetadata(
            num_reqs=cam.num_reqs,
            max_query_len=cam.max_query_len,
            max_seq_len=cam.max_seq_len,
            num_actual_tokens=cam.num_actual_tokens,
            query_start_loc=cam.query_start_loc,
            slot_mapping=cam.slot_mapping,
            block_table=cam.block_table_tensor,
            req_id_per_token=req_id_per_token,
            seq_lens=cam.seq_lens,
            block_size=self.kv_cache_spec.block_size,
            topk_tokens=self.topk_tokens,
            num_decodes=num_decodes,
            num_prefills=num_prefills,
            num_decode_tokens=num_decode_tokens,
            prefill=None,
            physical_indices=self.physical_indices_buffer,
        )


def token_to_request(cam: CommonAttentionMetadata, buffer: torch.Tensor) -> torch.Tensor:
    """Request index of every scheduled token, in ``buffer``. On CUDA vLLM's own kernel
    (graph-safe, reads the device ``query_start_loc``); elsewhere from the CPU copy with
    torch (vLLM's is Triton, which vLLM CPU runs without). Padding tokens map to 0."""
    if buffer.is_cuda:
        return cam.token_to_req_indices(buffer)
    num_tokens = cam.num_actual_tokens
    starts = cam.query_start_loc_cpu
    lengths = (starts[1:] - starts[:-1]).long()
    mapped = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    out = buffer[:num_tokens]
    out.zero_()
    count = min(num_tokens, mapped.numel())
    out[:count] = mapped[:count].to(out.dtype)
    return out
