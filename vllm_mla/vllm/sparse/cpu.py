"""Feature ``sparse-cpu``: the DSA lightning indexer of DeepSeek-V3.2 / GLM-5 on vLLM CPU.

vLLM's CPU ``SparseAttnIndexer.forward_cpu`` is DeepSeek-V4's: it refuses the V3.2
indexer (``skip_k_cache_insert=False``), fixes top-k at 512 and uses kernels the
non-AVX512-BF16 builds lack. Two of vLLM's extension APIs put ours in its place:

- ``SparseAttnIndexer.register_oot(PortableSparseAttnIndexer)``
  (``vllm_mla.vllm.sparse.indexer``): vLLM instantiates our subclass wherever a model
  builds its indexer. Its ``forward_cpu`` runs the torch indexer
  (``vllm_mla.ops.sparse_indexer``: index-key quantize + insert, logits, top-k for any
  K) for V3.2-style indexers and hands DeepSeek-V4's (``skip_k_cache_insert``) to vLLM's
  own ``forward_cpu``.
- ``vllm.triton_utils.dispatcher.register_kernels``: torch stand-ins for the indexer
  metadata builder's Triton kernels, which vLLM CPU runs without:
  ``BuildPrefillChunkMetadataKernel`` (every prefill chunk) and
  ``PrepareUniformDecodeKernel`` (speculative decoding with more draft tokens than the
  native decode path takes, e.g. MTP with 3: each request's rows flattened to one row per
  token).

Both happen once per process, only on a CPU platform without Triton. DeepSeek-V4's own
CPU path gets its metadata kernels' stand-ins when vLLM imports its CPU model
(``sparse.dsv4_cpu``).
"""

from __future__ import annotations

import logging

import torch

from vllm_mla.ops.dcp import DCPShard
from vllm_mla.vllm.sparse import dsv4_cpu, indexer, kernel_targets, kpool_indexer

logger = logging.getLogger("vllm_mla")
PREFILL_KERNEL = "vllm.v1.attention.backends.mla.indexer.BuildPrefillChunkMetadataKernel.kernel"
DECODE_KERNEL = "vllm.v1.attention.backends.mla.indexer.PrepareUniformDecodeKernel.kernel"
_registered: str | None = None


def build_prefill_chunk_metadata(*args, **kwargs) -> None:
    """The kernel's outputs, in torch: per token ``ks`` = its request's row start, ``ke`` =
    row start + causal context length (compressed); ``token_to_seq`` per gathered key.
    A token's context is its position + 1: from ``positions_ptr`` where vLLM passes one
    (0.34, ShardQ: a request's tokens need not be its last ones), else the request's last
    tokens. Under DCP (``DCP_WORLD`` > 1) the row starts are this rank's and the context
    length is the part of it this rank holds (``DCPShard.local_length``, the kernel's
    formula). Arguments are read by the installed kernel's parameter names."""
    a = kernel_targets.bind(PREFILL_KERNEL, args, kwargs)
    query_start_loc, slice_start, slice_stop = (
        a["query_start_loc_ptr"],
        a["query_slice_start"],
        a["query_slice_stop"],
    )
    seq_lens, cu_compressed = a["uncompressed_seq_lens_ptr"], a["cu_compressed_seq_lens_ptr"]
    ks, ke = a["cu_compressed_seq_len_ks_ptr"], a["cu_compressed_seq_len_ke_ptr"]
    positions = a.get("positions_ptr")
    ratio = int(a.get("COMPRESS_RATIO", 1))
    shard = DCPShard(int(a["DCP_WORLD"]), int(a["DCP_RANK"]), int(a["DCP_INTERLEAVE"]))
    for req in range(seq_lens.numel()):
        q0, q1 = int(query_start_loc[req]), int(query_start_loc[req + 1])
        s0, s1 = int(cu_compressed[req]), int(cu_compressed[req + 1])
        row_start = int(a["row_start_cu_compressed_seq_lens_ptr"][req])
        a["token_to_seq_ptr"][s0:s1] = req
        absolute = torch.arange(q0, q1)
        keep = (absolute >= slice_start) & (absolute < slice_stop)
        out = (absolute - slice_start)[keep]
        if positions is not None:
            context = positions[q0:q1].long() + 1
        else:
            start_pos = int(seq_lens[req]) - (q1 - q0)
            context = start_pos + 1 + torch.arange(q1 - q0)
        context = shard.local_length(context[keep] // ratio)
        ks[out] = row_start
        ke[out] = (row_start + context).to(ke.dtype)


def prepare_uniform_decode(
    seq_lens_ptr: torch.Tensor,
    decode_seq_lens_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    expanded_block_table_ptr: torch.Tensor,
    expanded_bt_stride: int,
    decode_lens_ptr: torch.Tensor,
    max_decode_len: int,
    BLOCK_SIZE: int = 0,  # the kernel's own parameter names: launches bind by name
) -> None:
    """The kernel's outputs, in torch: every request's ``max_decode_len`` decode tokens
    flattened to one row each, token ``j`` of request ``b`` attending to ``seq_lens[b] -
    max_decode_len + j + 1`` keys (clamped at 0), with its request's block-table row and a
    decode length of 1. The launch grid (one program per token) is not passed: it is
    ``seq_lens_ptr.numel() * max_decode_len``, as the builder hands exactly its decode
    requests' lengths."""
    requests = seq_lens_ptr.numel()
    tokens = requests * max_decode_len
    offsets = torch.arange(1 - max_decode_len, 1, device=seq_lens_ptr.device)
    per_token = (seq_lens_ptr.reshape(-1, 1) + offsets).clamp_min(0)
    decode_seq_lens_ptr[:tokens] = per_token.reshape(-1).to(decode_seq_lens_ptr.dtype)
    width = min(block_table_ptr.shape[-1], expanded_block_table_ptr.shape[-1])
    rows = block_table_ptr.reshape(requests, -1)[:, :width]
    expanded_block_table_ptr[:tokens, :width] = rows.repeat_interleave(max_decode_len, dim=0)
    decode_lens_ptr[:tokens] = 1


def register() -> str:
    """Install the CPU indexer and the metadata kernel stand-in (once); what happened."""
    global _registered
    if _registered is not None:
        return _registered
    from vllm.triton_utils import HAS_TRITON

    done = [
        indexer.register("cpu"),
        kpool_indexer.register_on_import("cpu"),
        dsv4_cpu.register_on_import(),
    ]
    if not HAS_TRITON:
        kernel_targets.remember(PREFILL_KERNEL)  # its parameter order, before the override
        kernel_targets.register(
            {PREFILL_KERNEL: build_prefill_chunk_metadata, DECODE_KERNEL: prepare_uniform_decode}
        )
        done.append(
            "indexer prefill-chunk and flattened-decode metadata in torch (register_kernels)"
        )
    _registered = "; ".join(done)
    return _registered
