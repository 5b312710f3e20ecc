"""Feature ``sparse-cpu``: the DSA lightning indexer of DeepSeek-V3.2 / GLM-5 on vLLM CPU.

vLLM's CPU ``SparseAttnIndexer.forward_cpu`` is DeepSeek-V4's: it refuses the V3.2
indexer (``skip_k_cache_insert=False``), fixes top-k at 512 and uses kernels the
non-AVX512-BF16 builds lack. Two of vLLM's extension APIs put ours in its place:

- ``SparseAttnIndexer.register_oot(CPUSparseAttnIndexer)``: vLLM instantiates our
  subclass wherever a model builds its indexer. Its ``forward_cpu`` runs the torch
  indexer (``vllm_mla.ops.sparse_indexer``: index-key quantize + insert, logits, top-k
  for any K) for V3.2-style indexers and hands DeepSeek-V4's (``skip_k_cache_insert``)
  to vLLM's own ``forward_cpu``; every other platform method is vLLM's.
- ``vllm.triton_utils.dispatcher.register_kernels``: a torch stand-in for the indexer
  metadata builder's ``BuildPrefillChunkMetadataKernel`` (Triton, which vLLM CPU runs
  without).

Both happen once per process, only on a CPU platform without Triton.
"""

from __future__ import annotations

import logging

import torch

from vllm_mla.ops import sparse_indexer
from vllm_mla.vllm import telemetry

logger = logging.getLogger("vllm_mla")
PREFILL_KERNEL = "vllm.v1.attention.backends.mla.indexer.BuildPrefillChunkMetadataKernel.kernel"
_registered: str | None = None


def build_prefill_chunk_metadata(
    query_start_loc_ptr: torch.Tensor,
    uncompressed_seq_lens_ptr: torch.Tensor,
    cu_compressed_seq_lens_ptr: torch.Tensor,
    row_start_cu_compressed_seq_lens_ptr: torch.Tensor,
    token_to_seq_ptr: torch.Tensor,
    cu_compressed_seq_len_ks_ptr: torch.Tensor,
    cu_compressed_seq_len_ke_ptr: torch.Tensor,
    query_slice_start: int,
    query_slice_stop: int,
    DCP_RANK: int,  # the kernel's own parameter names: launches bind by name
    DCP_WORLD: int,
    DCP_INTERLEAVE: int,
    BLOCK_SIZE: int = 0,
    COMPRESS_RATIO: int = 1,
) -> None:
    """The kernel's outputs, in torch: per token ``ks`` = its request's row start, ``ke`` =
    row start + causal context length (compressed); ``token_to_seq`` per gathered key."""
    if DCP_WORLD > 1:
        raise NotImplementedError("the CPU DSA indexer does not support DCP")
    num_reqs = uncompressed_seq_lens_ptr.numel()
    for req in range(num_reqs):
        q0, q1 = int(query_start_loc_ptr[req]), int(query_start_loc_ptr[req + 1])
        s0, s1 = int(cu_compressed_seq_lens_ptr[req]), int(cu_compressed_seq_lens_ptr[req + 1])
        row_start = int(row_start_cu_compressed_seq_lens_ptr[req])
        start_pos = int(uncompressed_seq_lens_ptr[req]) - (q1 - q0)
        token_to_seq_ptr[s0:s1] = req
        absolute = torch.arange(q0, q1)
        keep = (absolute >= query_slice_start) & (absolute < query_slice_stop)
        out = (absolute - query_slice_start)[keep]
        context = (start_pos + 1 + torch.arange(q1 - q0))[keep] // COMPRESS_RATIO
        cu_compressed_seq_len_ks_ptr[out] = row_start
        cu_compressed_seq_len_ke_ptr[out] = (row_start + context).to(
            cu_compressed_seq_len_ke_ptr.dtype
        )


def token_contexts(meta) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(batch token ids, their requests' block-table rows [n, W], causal lengths [n]) for
    every token the indexer scores in a step, from vLLM's ``DeepseekV32IndexerMetadata``."""
    tokens: list[int] = []
    tables: list[torch.Tensor] = []
    lengths: list[torch.Tensor] = []
    decode = meta.decode
    if meta.num_decodes and decode is not None:
        if decode.requires_padding:
            raise NotImplementedError(
                "the CPU DSA indexer serves uniform decode only (no padded spec-decode batches)"
            )
        seq = decode.seq_lens
        per_req = seq.shape[1] if seq.dim() == 2 else 1
        seq = seq.reshape(seq.shape[0], per_req)
        for b in range(seq.shape[0]):
            for j in range(per_req):
                tokens.append(b * per_req + j)
                tables.append(decode.block_table[b])
                lengths.append(seq[b, j])
    prefill = meta.prefill
    if meta.num_prefills and prefill is not None:
        for chunk in prefill.chunks:
            starts = chunk.cu_seq_lens.long()
            for i, t in enumerate(range(chunk.token_start, chunk.token_end)):
                ks, ke = int(chunk.cu_seqlen_ks[i]), int(chunk.cu_seqlen_ke[i])
                req = int(torch.searchsorted(starts, torch.tensor(ks), right=True)) - 1
                tokens.append(t)
                tables.append(chunk.block_table[req])
                lengths.append(torch.tensor(ke - ks))
    if not tokens:
        empty = torch.empty(0, dtype=torch.int32)
        return [], empty.view(0, 0), empty
    return tokens, torch.stack(tables), torch.stack(lengths).to(torch.int32)


def _indexer_base():
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    return SparseAttnIndexer


def make_cpu_indexer() -> type:
    """``CPUSparseAttnIndexer``: vLLM's SparseAttnIndexer with a V3.2-capable forward_cpu."""
    base = _indexer_base()

    class CPUSparseAttnIndexer(base):
        """The DSA indexer on CPU through ``vllm_mla.ops.sparse_indexer`` (torch)."""

        def forward_cpu(self, hidden_states, q_quant, k, weights):
            if self.skip_k_cache_insert or self.use_fp4_cache:  # DeepSeek-V4: vLLM's own
                return super().forward_cpu(hidden_states, q_quant, k, weights)
            from vllm.forward_context import get_forward_context

            attn_metadata = get_forward_context().attn_metadata
            meta = (
                attn_metadata.get(self.k_cache.prefix) if isinstance(attn_metadata, dict) else None
            )
            if meta is None:  # profile / dummy run: nothing to select
                return self.topk_indices_buffer
            cache = self.k_cache.kv_cache
            slots = meta.slot_mapping
            sparse_indexer.insert_keys(
                cache, k[: slots.shape[0]], slots, ue8m0=self.scale_fmt == "ue8m0"
            )
            buffer = self.topk_indices_buffer
            buffer[: hidden_states.shape[0]] = -1
            tokens, tables, lengths = token_contexts(meta)
            if tokens:
                rows = torch.tensor(tokens, device=buffer.device)
                picked = sparse_indexer.index_topk(
                    q_quant.float()[rows], weights[rows], cache, tables, lengths, self.topk_tokens
                )
                buffer[rows] = picked
            telemetry.record_sparse("indexer:cpu")
            return buffer

    CPUSparseAttnIndexer.__qualname__ = "CPUSparseAttnIndexer"
    return CPUSparseAttnIndexer


def register() -> str:
    """Install the CPU indexer and the metadata kernel stand-in (once); what happened."""
    global _registered
    if _registered is not None:
        return _registered
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.triton_utils import HAS_TRITON

    done = []
    base = _indexer_base()
    if base.__name__ not in op_registry_oot:
        base.register_oot(make_cpu_indexer())
        done.append("CPU DSA indexer (SparseAttnIndexer.register_oot)")
    if not HAS_TRITON:
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({PREFILL_KERNEL: build_prefill_chunk_metadata})
        done.append("indexer prefill-chunk metadata in torch (register_kernels)")
    _registered = "registered " + " and ".join(done) if done else "nothing to register"
    return _registered
