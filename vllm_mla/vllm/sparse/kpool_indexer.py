"""The portable kpool DSA indexer of GLM-5.3-Flash (``Glm5NextForCausalLM``): vLLM's
``SparseAttnIndexerKpool`` where vLLM's own cannot run.

vLLM 0.32 / 0.33 build it in ``vllm/models/glm5next/common/attention.py``
(``Indexer.__init__``) from ``vllm/models/glm5next/nvidia/sparse_indexer.py``: its
constructor raises on CUDA without DeepGEMM, and every forward (``forward_cuda``; on CPU
``forward_native`` -> ``forward_cuda``) runs ``sparse_attn_indexer_kpool``: DeepGEMM MQA
logits and vLLM's Triton kpool kernels, neither of which vLLM CPU has. vLLM's extension
API puts ours in its place without a monkeypatch: ``SparseAttnIndexerKpool.register_oot``.

``PortableSparseAttnIndexerKpool`` runs ``vllm_mla.ops.kpool_indexer`` on vLLM's own
metadata (``DeepseekV32IndexerMetadata`` of the pool cache, whose ``slot_mapping`` is
pool-granular, and of the tail ring, token-granular ``block * ring + pos % ring``):

- **Pool writes** (``update_pools``, prefill and decode alike): a token completing a pool
  (``pos % kpool == kpool - 1``, pool slot >= 0) compresses the pool's ``kpool`` keys,
  each taken from this step's batch when its token is there (same tail block, consecutive
  position) and from the tail ring otherwise, then inserts it (``api.compress_pools``,
  ``api.insert_pools``); then tokens are stashed in the ring: every decode token, and a
  prefill request's last ``kpool`` tokens (vLLM's ``kpool_seed_tail_cache`` rule). With
  pool-aligned prefill chunks (what vLLM's kernel assumes: it gathers the pool from the
  batch rows only) this writes vLLM's bytes; a chunk starting mid-pool reads the ring
  the previous chunk seeded.
- **Selection** (``select``): every scored token's ``api.index_topk`` over its request's
  pools (token-granular length ``positions + 1``, as vLLM's expansion reads it), into
  ``topk_indices_buffer`` at its full width (``round_up(topk + kpool - 1, 128)``, -1
  past the tail). Prefill rows are scored per vLLM prefill chunk (the chunk's block
  table); rows of requests too short to hold a pool (vLLM builds no chunk for them) get
  their tail. Short contexts (``L <= topk``) get the same set vLLM's causal fill writes,
  in the reference's layout (``ops.kpool_indexer.reference``).
- **Wired lazily** (``register_on_import``, by the plugin's ``sparse-cpu`` and
  ``sparse-indexer`` features): an import hook registers it when vLLM imports
  GLM-5.3-Flash's indexer module, so other models' processes never import that package
  (3-8 s on a 2-core CPU). ``register(platform)`` installs it at once.
- **CPU** (``register("cpu")``): the torch reference (telemetry ``indexer:kpool:cpu``).
  **CUDA** (``register("cuda")``, ``VLLM_MLA_INDEXER`` as for the V3.2 indexer:
  ours where DeepGEMM is missing or the GPU is SM12x): the Triton kernels
  (``indexer:kpool:triton``), run as vLLM runs its own, an eager break under breakable
  CUDA graphs (``eager_break_during_capture``). Elsewhere vLLM's op runs unchanged.

Refused at construction (``refusals``; the message names the setting): decode / prefill
context parallelism (vLLM's ``pool_cp_interleave`` sharding of the pool cache), the MXFP4
index cache, ``skip_k_cache_insert``, no tail cache, an index head dim other than 128,
and, where the pool size is known then, a top-k that is not a multiple of it or a top-k
buffer narrower than ``topk + kpool - 1``. On vLLM CPU, MTP speculative decoding is
refused there too, with vLLM's reason (``speculative_refusal``): its v1 proposer needs the
draft's layers in one KV-cache group, and an MTP layer's tail ring is a second one.

Construction on CUDA without DeepGEMM: vLLM's ``__init__`` raises when
``current_platform.is_cuda() and not has_deep_gemm()``; ours runs it with that module's
``has_deep_gemm`` answering True for the call (``indexer._deep_gemm_guard_lifted``; a
test reads vLLM's source to confirm the guard). Removal: when vLLM checks for DeepGEMM in
its forward only.

Stand-ins for vLLM's Triton kernels the model calls directly (``STAND_INS``, registered
through ``vllm.triton_utils.dispatcher.register_kernels`` on a CPU platform without
Triton, each with its why / how / removal).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys

import torch

from vllm_mla.formats import INDEX_HEAD_DIM
from vllm_mla.ops.kpool_indexer import api
from vllm_mla.ops.kpool_indexer.reference import compressed_slot_mapping as reference_slots
from vllm_mla.ops.kpool_indexer.reference import expand_pools_and_tail, quantize_query
from vllm_mla.vllm import on_import, telemetry
from vllm_mla.vllm.sparse import indexer as dsa_indexer
from vllm_mla.vllm.sparse import kernel_targets

BASE_MODULE = "vllm.models.glm5next.nvidia.sparse_indexer"
KERNELS_MODULE = "vllm.models.glm5next.nvidia.ops.kpool_compress"
CLASS_NAME = "PortableSparseAttnIndexerKpool"
_registered: str | None = None


# -- vLLM's Triton kernels the model launches itself: torch stand-ins on CPU --------------
def fwht_quant(q_ptr, qout_ptr, sout_ptr, n_rows, BLOCK_R=32, **launch_options) -> None:
    """``_fwht_quant_kernel``'s outputs (the kernel's own parameter names): rows ``q
    [n, 128]`` bf16 rotated by Hadamard-128, bf16, ue8m0 e4m3 (floor 1e-4) into ``qout
    [n, 128]`` and their scales into ``sout [n, 1]`` (``reference.quantize_query``)."""
    n = int(n_rows)
    values, scales = quantize_query(q_ptr[:n].reshape(n, 1, INDEX_HEAD_DIM))
    qout_ptr[:n] = values.reshape(n, INDEX_HEAD_DIM)
    sout_ptr.reshape(-1)[:n] = scales.reshape(n)


def compressed_slot_mapping_kernel(
    compressed_slot_mapping_ptr: torch.Tensor,
    slot_mapping_ptr: torch.Tensor,
    query_start_loc_ptr: torch.Tensor,
    seq_lens_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    block_size: int,
    dcp_world_size: int,
    cp_interleave: int,
    COMPRESS_RATIO: int,  # the kernel's own parameter names: launches bind by name
    PAD_ID: int,
    TRITON_BLOCK_SIZE: int = 0,
) -> None:
    """``CompressedSlotMappingKernel``'s output: the token at position ``p`` of request
    ``b`` writes its compressed state iff ``(p + 1) % ratio == 0`` and its own slot is not
    ``PAD_ID``, at the slot ``reference.compressed_slot_mapping`` gives the state of its
    (DCP-local) position; ``PAD_ID`` otherwise. One request per block-table row (the
    kernel's grid); tokens past the requests are left as they are."""
    table = block_table_ptr.reshape(-1, block_table_stride)
    reqs = min(table.shape[0], query_start_loc_ptr.numel() - 1, seq_lens_ptr.numel())
    starts = query_start_loc_ptr[: reqs + 1].long()
    lens = starts[1:] - starts[:-1]
    if reqs == 0 or int(lens.sum()) == 0:
        return
    tokens = torch.arange(int(starts[0]), int(starts[reqs]), device=starts.device)
    request = torch.repeat_interleave(torch.arange(reqs, device=starts.device), lens)
    pos = seq_lens_ptr[:reqs].long()[request] - lens[request] + tokens - starts[request]
    width = cp_interleave * dcp_world_size
    local = pos // width * cp_interleave + pos % cp_interleave
    # the state's last local position: the reference maps it to the state's slot
    last = local // COMPRESS_RATIO * COMPRESS_RATIO + COMPRESS_RATIO - 1
    slots = reference_slots(last, table[request], block_size, COMPRESS_RATIO)
    valid = ((pos + 1) % COMPRESS_RATIO == 0) & (slot_mapping_ptr[tokens].long() != PAD_ID)
    out = torch.where(valid, slots, PAD_ID)
    compressed_slot_mapping_ptr[tokens] = out.to(compressed_slot_mapping_ptr.dtype)


def fused_q_kv_rmsnorm_kernel(
    q_ptr: torch.Tensor,
    q_out_ptr: torch.Tensor,
    q_weight_ptr: torch.Tensor,
    q_in_stride: int,
    q_out_stride: int,
    kv_ptr: torch.Tensor,
    kv_out_ptr: torch.Tensor,
    kv_weight_ptr: torch.Tensor,
    kv_in_stride: int,
    kv_out_stride: int,
    eps: float,
    Q_SIZE: int,  # the kernel's own parameter names: launches bind by name
    KV_SIZE: int,
    BLOCK_SIZE: int = 0,
    launch_pdl: bool = False,
) -> None:
    """``FusedQKVRMSNormKernel``'s outputs: each row of ``q`` and of ``kv`` RMS-normalized
    with its weight, one ``eps`` for both (the kernel's), in fp32 with one cast at the
    store, as the kernel computes."""
    for x, out, weight, size in (
        (q_ptr, q_out_ptr, q_weight_ptr, Q_SIZE),
        (kv_ptr, kv_out_ptr, kv_weight_ptr, KV_SIZE),
    ):
        rows = x[:, :size].float()
        normed = rows * torch.rsqrt(rows.square().mean(-1, keepdim=True) + eps)
        out[:, :size] = (normed * weight[:size].float()).to(out.dtype)


STAND_INS: tuple[kernel_targets.StandIn, ...] = (
    kernel_targets.StandIn(
        kernel=f"{KERNELS_MODULE}._fwht_quant_kernel",
        impl=fwht_quant,
        why="the kpool indexer's query rotation and quantization (fwht128_quant_fp8, called "
        "by glm5next Indexer.forward) launches this Triton kernel on every platform",
        how="vLLM's launcher runs unchanged (triton.cdiv is the placeholder's); the launch "
        "goes to ops.kpool_indexer.reference.quantize_query (same butterflies, bf16 "
        "rounding, ue8m0 e4m3 with floor 1e-4)",
        removal="when vLLM ships a CPU fwht128_quant_fp8",
    ),
    kernel_targets.StandIn(
        kernel="vllm.v1.attention.backends.mla.compressor_utils.CompressedSlotMappingKernel.kernel",
        impl=compressed_slot_mapping_kernel,
        why="the indexer metadata builder maps each token to its pool slot "
        "(get_compressed_slot_mapping) with this Triton kernel whenever the index cache "
        "is compressed (tokens_per_state = index_kpool)",
        how="ops.kpool_indexer.reference.compressed_slot_mapping of each token's state, "
        "with the kernel's PAD rule (a PAD token slot stays PAD) and DCP-local positions",
        removal="when vLLM registers a CPU CompressedSlotMappingKernel",
    ),
    kernel_targets.StandIn(
        kernel="vllm.models.common.ops.fused_qk_rmsnorm.FusedQKVRMSNormKernel.kernel",
        impl=kernel_targets.launched_by_name(fused_q_kv_rmsnorm_kernel),
        why="GLM-5.3-Flash's MLA layers ask vLLM's MLA wrapper for fuse_qkv_rmsnorm=True "
        "(glm5next/common/attention.py), whose q_a / kv_a RMSNorm is this Triton kernel "
        "on every platform",
        how="fp32 RMSNorm of each q / kv row with its weight and the kernel's one eps, cast "
        "once at the store",
        removal="when vLLM CPU runs fused_q_kv_rmsnorm without Triton",
    ),
)


# -- what ours does not serve ---------------------------------------------------------------
def refusals(layer: object, parallel: object | None) -> list[str]:
    """Each setting of ``layer`` (vLLM's constructor arguments) or ``parallel`` (vLLM's
    parallel config) the portable kpool indexer does not serve, named."""
    out = []
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1:
        out.append(
            f"decode_context_parallel_size={dcp} (DCP: vLLM shards the pool cache by "
            "pool_cp_interleave; ours serves one rank holding every pool)"
        )
    if pcp > 1:
        out.append(f"prefill_context_parallel_size={pcp} (PCP)")
    if getattr(layer, "use_fp4_cache", False):
        out.append("use_fp4_cache=True (indexer_kv_dtype=mxfp4: ours writes the fp8 cache)")
    if getattr(layer, "skip_k_cache_insert", False):
        out.append("skip_k_cache_insert=True (ours writes the pools itself)")
    if getattr(layer, "tail_cache", None) is None:
        out.append("tail_cache=None (decode completes pools from the tail ring)")
    if getattr(layer, "head_dim", INDEX_HEAD_DIM) != INDEX_HEAD_DIM:
        out.append(f"head_dim={layer.head_dim} (the index head dim is {INDEX_HEAD_DIM})")
    kpool = getattr(getattr(layer, "k_cache", None), "_index_kpool", None)
    topk = getattr(layer, "topk_tokens", None)
    if isinstance(kpool, int) and isinstance(topk, int):
        if kpool < 1 or topk < kpool or topk % kpool:
            out.append(f"index_topk={topk} (not a positive multiple of index_kpool={kpool})")
        width = layer.topk_indices_buffer.shape[-1]
        if width < topk + kpool - 1:
            out.append(f"a top-k buffer {width} wide (needs topk + kpool - 1 = {topk + kpool - 1})")
    return out


V1_PROPOSER = "vllm.v1.spec_decode.llm_base_proposer"


def speculative_refusal(speculative: object | None, on_cpu: bool) -> str | None:
    """Why vLLM cannot serve ``speculative`` (its speculative config) for a kpool model on
    this platform, or None. vLLM's v1 speculative proposer (``V1_PROPOSER``, what vLLM CPU
    0.32 runs) needs every draft attention layer in one KV-cache group
    (``validate_same_kv_cache_group``), and a GLM-5.3-Flash MTP layer keeps its indexer's
    tail ring (a ``CircularBufferSpec`` of ring-sized blocks) in a second one; vLLM serves
    it with its GPU model runner v2 (``gpu/spec_decode/mtp``) only."""
    if getattr(speculative, "method", None) != "mtp" or not on_cpu:
        return None
    if importlib.util.find_spec(V1_PROPOSER) is None:
        return None
    return (
        "speculative_config method=mtp with a GLM-5.3-Flash (kpool indexer) model on vLLM "
        "CPU: the MTP draft layer's tail ring is a second KV-cache group, and vLLM's v1 "
        "speculative proposer needs one ('All drafting layers should belong to the same kv "
        "cache group'); run without speculative decoding"
    )


def _refuse(layer: object, parallel: object | None) -> None:
    found = refusals(layer, parallel)
    if found:
        raise NotImplementedError(
            "the portable kpool indexer (vllm-mla) does not serve "
            + "; ".join(found)
            + ". Use the default setting, or vLLM's own indexer where it runs "
            "(CUDA with DeepGEMM, VLLM_MLA_INDEXER=vllm)"
        )


# -- pool writes: prefill and decode --------------------------------------------------------
def _ahead_in_same_block(tail_slots: torch.Tensor, kpool: int, ring: int) -> torch.Tensor:
    """Per token: whether the token ``kpool`` rows later is in this batch and its request
    (same tail block): vLLM's seed rule keeps the others, each request's last ``kpool``."""
    n = tail_slots.shape[0]
    ahead = torch.full_like(tail_slots, -1)
    if n > kpool:
        ahead[: n - kpool] = tail_slots[kpool:]
    same = (ahead >= 0) & (ahead.clamp_min(0) // ring == tail_slots.clamp_min(0) // ring)
    return same


def update_pools(
    pool_cache: torch.Tensor,
    tail_cache: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    pool_slots: torch.Tensor,
    tail_slots: torch.Tensor,
    *,
    stash_all: bool,
    round_scale: bool = True,
    impl: str = "auto",
) -> None:
    """Complete every pool whose last token is among these ``n`` tokens, then stash tokens
    in the tail ring (``tail_cache [nb, 2, ring, 128]`` bf16, K then gate).

    A pool's earlier key at position ``p - j`` comes from row ``t - j`` when that row holds
    it (its request's tail block, position ``p - j``), else from the ring slot ``(p - j) %
    ring`` (written by an earlier step): every read happens before this step's stashes,
    which is what vLLM's sequential per-request kernel reads (a ring of at least ``kpool +
    drafts`` slots is never overwritten within a step). ``stash_all``: every token with a
    tail slot (decode); else each request's last ``kpool`` tokens (prefill seeding).
    Equals ``reference.decode_step`` token by token.
    """
    n = k.shape[0]
    if n == 0:
        return
    kpool, ring = ape.shape[0], tail_cache.shape[2]
    pos, tslot, pslot = positions.long(), tail_slots.long(), pool_slots.long()
    block = tslot.clamp_min(0) // ring
    kb, gb = k.to(torch.bfloat16), gate.to(torch.bfloat16)
    rows = torch.arange(n, device=k.device)
    keys, gates = [], []
    for s in range(kpool):
        back = kpool - 1 - s
        src = (rows - back).clamp_min(0)
        here = (rows >= back) & (tslot >= 0) & (tslot[src] >= 0)
        here = here & (block[src] == block) & (pos[src] == pos - back)
        phys = torch.remainder(pos - back, ring)
        keys.append(torch.where(here[:, None], kb[src], tail_cache[block, 0, phys]))
        gates.append(torch.where(here[:, None], gb[src], tail_cache[block, 1, phys]))
    rotated = api.compress_pools(torch.stack(keys, 1), torch.stack(gates, 1), ape, impl=impl)
    completes = (pslot >= 0) & (pos >= 0) & (torch.remainder(pos, kpool) == kpool - 1)
    slots = torch.where(completes, pslot, -1)
    api.insert_pools(pool_cache, rotated, slots, round_scale=round_scale, impl=impl)
    keep = (tslot >= 0) & (pos >= 0)
    if not stash_all:
        keep = keep & ~_ahead_in_same_block(tslot, kpool, ring)
    phys = torch.remainder(pos[keep], ring)
    tail_cache[block[keep], 0, phys] = kb[keep]
    tail_cache[block[keep], 1, phys] = gb[keep]


# -- selection ------------------------------------------------------------------------------
def step_groups(
    meta: object, positions: torch.Tensor, kpool: int, max_pool_len: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Per group of scored tokens (decode first, then each prefill chunk): ``(rows, their
    block-table rows, token-granular causal lengths positions + 1, a host bound of their
    pool counts)``. Tensor ops only."""
    groups = []
    nd = meta.num_decode_tokens
    if meta.num_decodes and meta.decode is not None:
        _, tables, _ = dsa_indexer._decode_tokens(meta.decode, nd)
        rows = torch.arange(nd, device=positions.device)
        groups.append((rows, tables[:nd], positions[:nd].long() + 1, max_pool_len))
    prefill = meta.prefill
    if meta.num_prefills and prefill is not None:
        for chunk in prefill.chunks:
            n = chunk.token_end - chunk.token_start
            ks = chunk.cu_seqlen_ks[:n].long()
            request = torch.searchsorted(chunk.cu_seq_lens.long(), ks, right=True) - 1
            # a request holding no pool repeats the next one's start: clamp (no pool, no
            # table read; its tokens get only their tail)
            request = request.clamp(0, chunk.num_reqs - 1)
            rows = torch.arange(chunk.token_start, chunk.token_end, device=ks.device)
            bound = getattr(chunk, "max_seqlen_k", None) or int(meta.max_seq_len) // kpool
            lengths = positions[chunk.token_start : chunk.token_end].long() + 1
            groups.append((rows, chunk.block_table[request], lengths, int(bound)))
    return groups


def select(
    layer: object,
    num_rows: int,
    q: torch.Tensor,
    weights: torch.Tensor,
    meta: object,
    positions: torch.Tensor,
    kpool: int,
    *,
    impl: str,
    budget_bytes: int | None = None,
) -> torch.Tensor:
    """Write every scored token's top-k (request-local token indices, -1 padded, the
    buffer's full width) into ``layer.topk_indices_buffer``; returns the buffer.
    ``budget_bytes``: at most this many bytes of pool logits and top-k temporaries at
    once (row blocks sized on the host, as the V3.2 indexer's)."""
    cache = layer.k_cache.kv_cache
    buffer = layer.topk_indices_buffer
    width, topk = buffer.shape[1], layer.topk_tokens
    buffer[:num_rows] = -1
    nd, end = meta.num_decode_tokens, meta.slot_mapping.shape[0]
    if end > nd:  # prefill rows outside every chunk hold no pool: their tail only
        none = torch.full((end - nd, topk // kpool), -1, dtype=torch.int32, device=q.device)
        buffer[nd:end] = expand_pools_and_tail(none, positions[nd:end].long() + 1, kpool, width)
    q_rows = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
    for rows, tables, lengths, bound in step_groups(meta, positions, kpool, layer.max_pool_len):
        per_score = dsa_indexer.TOPK_BYTES_PER_SCORE
        for start, size in dsa_indexer._row_blocks(rows.shape[0], bound, budget_bytes, per_score):
            part = slice(start, start + size)
            buffer[rows[part]] = api.index_topk(
                q_rows[rows[part]].view(q.dtype),
                weights[rows[part]].float(),
                cache,
                tables[part],
                lengths[part],
                topk,
                kpool,
                max_pools=bound,
                width=width,
                impl=impl,
            )
    return buffer


def run_step(
    layer: object,
    hidden_states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    kpool: int,
    positions: torch.Tensor,
    impl: str,
) -> torch.Tensor:
    """One indexer step on vLLM's forward-context metadata: pool writes (prefill, then
    decode through the ring), then the selection; returns ``topk_indices_buffer``."""
    from vllm.forward_context import get_forward_context

    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):  # profile / dummy run
        if hidden_states.device.type == "cuda":  # vLLM's indexer reserves this peak too
            dsa_indexer._reserve_logits_peak(hidden_states.device)
        return layer.topk_indices_buffer
    meta = attn_metadata[layer.k_cache.prefix]
    tail_meta = attn_metadata.get(layer.tail_cache.prefix)
    if tail_meta is None or positions is None:
        raise RuntimeError(
            "the portable kpool indexer needs the tail cache's metadata and the positions "
            f"(got tail metadata {type(tail_meta).__name__}, positions "
            f"{type(positions).__name__})"
        )
    slots = meta.slot_mapping
    n, nd = slots.shape[0], meta.num_decode_tokens
    round_scale = layer.scale_fmt is not None
    tail_cache, cache = layer.tail_cache.kv_cache, layer.k_cache.kv_cache
    tail_slots = tail_meta.slot_mapping
    for part, stash_all in ((slice(nd, n), False), (slice(0, nd), True)):
        update_pools(
            cache,
            tail_cache,
            k[part],
            gate[part],
            ape,
            positions[part],
            slots[part],
            tail_slots[part],
            stash_all=stash_all,
            round_scale=round_scale,
            impl=impl,
        )
    budget = dsa_indexer._logits_budget() if hidden_states.device.type == "cuda" else None
    return select(
        layer,
        hidden_states.shape[0],
        q,
        weights,
        meta,
        positions,
        kpool,
        impl=impl,
        budget_bytes=budget,
    )


def _parallel_config() -> object | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else config.parallel_config


def _refuse_speculative(on_cpu: bool) -> None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    reason = speculative_refusal(getattr(config, "speculative_config", None), on_cpu)
    if reason is not None:
        raise NotImplementedError(reason)


def make_indexer() -> type:
    """``PortableSparseAttnIndexerKpool``: vLLM's kpool indexer op with our CPU and CUDA
    paths (module docstring)."""
    module = importlib.import_module(BASE_MODULE)
    base = module.SparseAttnIndexerKpool
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    step = eager_break_during_capture(run_step)

    class PortableSparseAttnIndexerKpool(base):
        """vLLM's kpool indexer op; ours selects where vLLM's cannot (module docstring)."""

        def __init__(self, *args, **kwargs):
            from vllm.platforms import current_platform

            on_cuda = current_platform.is_cuda()
            ours = dsa_indexer.ours_on_cuda()[0] if on_cuda else True
            if ours:  # before vLLM's constructor, which asks for the DCP group
                probe = _Arguments(*args, **kwargs)
                _refuse(probe, _parallel_config())
            _refuse_speculative(current_platform.is_cpu())
            lifted = dsa_indexer._deep_gemm_guard_lifted(module) if ours and on_cuda else None
            with lifted or contextlib.nullcontext():
                super().__init__(*args, **kwargs)
            self.vllm_mla_ours = ours

        def _vllm_mla_forward(self, impl, hidden_states, q_quant, k, weights, **kw):
            kpool = int(kw.get("index_kpool", 1))
            gate, ape = kw.get("gate_score"), kw.get("compress_ape")
            if kpool <= 1 or gate is None or ape is None or isinstance(q_quant, tuple):
                raise NotImplementedError(
                    "the portable kpool indexer serves index_kpool > 1 with a gate score, "
                    f"compress_ape and an fp8 query (got index_kpool={kpool})"
                )
            positions = kw.get("positions")
            return step(self, hidden_states, q_quant, k, weights, gate, ape, kpool, positions, impl)

        def forward_cuda(self, hidden_states, q_quant, k, weights, **kw):
            if not self.vllm_mla_ours:
                return super().forward_cuda(hidden_states, q_quant, k, weights, **kw)
            telemetry.record_sparse("indexer:kpool:triton")
            return self._vllm_mla_forward("auto", hidden_states, q_quant, k, weights, **kw)

        def forward_cpu(self, hidden_states, q_quant, k, weights, **kw):
            telemetry.record_sparse("indexer:kpool:cpu")
            return self._vllm_mla_forward("reference", hidden_states, q_quant, k, weights, **kw)

        def forward_native(self, hidden_states, q_quant, k, weights, **kw):
            if hidden_states.device.type == "cpu":
                return self.forward_cpu(hidden_states, q_quant, k, weights, **kw)
            return self.forward_cuda(hidden_states, q_quant, k, weights, **kw)

    PortableSparseAttnIndexerKpool.__qualname__ = CLASS_NAME
    return PortableSparseAttnIndexerKpool


class _Arguments:
    """vLLM's ``SparseAttnIndexerKpool`` constructor arguments, by name (for ``refusals``
    before vLLM's constructor runs)."""

    NAMES = (
        "k_cache",
        "quant_block_size",
        "scale_fmt",
        "topk_tokens",
        "head_dim",
        "max_pool_len",
        "max_total_seq_len",
        "topk_indices_buffer",
        "skip_k_cache_insert",
        "use_fp4_cache",
        "tail_cache",
    )

    def __init__(self, *args, **kwargs):
        values = dict(zip(self.NAMES, args, strict=False))
        values.update(kwargs)
        for name in self.NAMES:
            setattr(self, name, values.get(name))
        self.skip_k_cache_insert = bool(self.skip_k_cache_insert)
        self.use_fp4_cache = bool(self.use_fp4_cache)


def register_stand_ins() -> str:
    """``STAND_INS`` through vLLM's ``register_kernels`` (CPU without Triton); what
    happened."""
    if not kernel_targets.register_stand_ins(STAND_INS):
        return "kpool kernels: vLLM's Triton runs here"
    return (
        "kpool query quantization, pool slot mapping and the fused q/kv RMSNorm in torch "
        "(register_kernels)"
    )


def register(platform: str) -> str:
    """Install the portable kpool indexer (once per process); what happened, for the log.

    ``platform``: ``"cpu"`` (feature ``sparse-cpu``: the op and ``STAND_INS``) or
    ``"cuda"`` (feature ``sparse-indexer``, only when ``VLLM_MLA_INDEXER`` resolves to
    ours). Without an importable GLM-5.3-Flash model in this vLLM: skipped, named.
    """
    global _registered
    from vllm.model_executor.custom_op import op_registry_oot

    if platform == "cuda":
        ours, why = dsa_indexer.ours_on_cuda()
        if not ours:
            return f"vLLM's kpool indexer kept ({why})"
    try:
        base = importlib.import_module(BASE_MODULE).SparseAttnIndexerKpool
    except (ImportError, AttributeError) as exc:
        return f"kpool indexer skipped: {BASE_MODULE} cannot be imported ({exc})"
    done = []
    owner = op_registry_oot.get(base.__name__)
    if owner is None:
        base.register_oot(make_indexer())
        done.append(f"registered the portable kpool indexer ({base.__name__}.register_oot)")
    elif getattr(owner, "__qualname__", "") != CLASS_NAME:
        return f"kpool indexer left to {owner.__module__}.{owner.__qualname__}"
    else:
        done.append("portable kpool indexer (already)")
    if platform == "cpu":
        done.append(register_stand_ins())
    _registered = "; ".join(done)
    return _registered


def register_on_import(platform: str) -> str:
    """Install the portable kpool indexer when vLLM imports GLM-5.3-Flash's indexer
    module (what loading a ``Glm5Next*`` model does, before any layer is built), so
    processes serving other models never pay that import (3-8 s on a 2-core CPU); at
    once if it is imported already. What happened, for the log."""
    if BASE_MODULE in sys.modules:
        return register(platform)

    def _register(module: object) -> None:
        logging.getLogger("vllm_mla").info("vllm-mla: %s", register(platform))

    on_import.when_imported(BASE_MODULE, _register)
    return f"kpool indexer: registered when {BASE_MODULE} is imported (a GLM-5.3-Flash model)"


__all__ = [
    "STAND_INS",
    "compressed_slot_mapping_kernel",
    "fused_q_kv_rmsnorm_kernel",
    "fwht_quant",
    "make_indexer",
    "refusals",
    "register",
    "register_on_import",
    "register_stand_ins",
    "select",
    "step_groups",
    "update_pools",
]
