"""The portable DSA lightning indexer (DeepSeek-V3.2 / GLM-5): vLLM's ``SparseAttnIndexer``
where vLLM's own cannot run.

vLLM 0.33's CUDA indexer needs DeepGEMM (``SparseAttnIndexer.__init__`` raises without
it; DeepGEMM serves Hopper and Blackwell only, its sparse MQA-logits kernels SM100), and
on SM12x its top-k fallback asks for more shared memory than the ~99 KiB there. Its CPU
``forward_cpu`` is DeepSeek-V4's (it refuses the V3.2 indexer). vLLM's own extension API
puts ours in its place without a monkeypatch: ``SparseAttnIndexer.register_oot(cls)``
makes every model that builds an indexer build ``cls`` instead.

``PortableSparseAttnIndexer`` (one class for both platforms, since an op has one
out-of-tree class):

- **CPU** (feature ``sparse-cpu``): ``forward_cpu`` selects with the torch oracle
  (``vllm_mla.ops.sparse_indexer.reference``).
- **CUDA** (feature ``sparse-indexer``, ``VLLM_MLA_INDEXER``): where the choice is ours,
  ``forward_cuda`` selects with the Triton kernels (``vllm_mla.ops.sparse_indexer.api``,
  chosen by its ``dispatch``: index-key insert, paged logits over each token's block table,
  exact top-k), all tensor ops: no host sync, no
  data-dependent shape (decode logits are ``[T, max_model_len]``), so a captured graph
  replays it. Otherwise vLLM's ``forward_cuda`` runs unchanged.
- Decode context parallelism (``decode_context_parallel_size`` > 1): ``select_dcp``, on
  both platforms (each rank scores its KV shard, local top-K candidates are merged over
  the DCP group: the selection equals the one without DCP, ``ops.sparse_indexer.dcp``).
- DeepSeek-V4's indexers (``skip_k_cache_insert``, fp4 cache, candidate blocks) and
  PCP always go to vLLM's own methods.

``VLLM_MLA_INDEXER``: ``auto`` (default: ours on CUDA when DeepGEMM is missing or the
GPU is SM12x; vLLM's elsewhere), ``ours``, ``vllm``.

Construction on CUDA without DeepGEMM: vLLM's ``__init__`` sets every attribute, then
raises when ``current_platform.is_cuda() and not has_deep_gemm()``. Ours runs it with
that module's ``has_deep_gemm`` answering True for the duration of the call (nothing
else in the constructor reads it; a test reads vLLM's source to confirm the guard is
still that one line). Removal: when vLLM checks for DeepGEMM in ``forward_cuda`` only.
"""

from __future__ import annotations

import contextlib
import logging
from types import ModuleType

import torch

from vllm_mla import envs
from vllm_mla.ops.dcp import NO_DCP, DCPShard
from vllm_mla.ops.sparse_indexer.dispatch import ReferenceKernels, kernels_for
from vllm_mla.vllm import telemetry

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # the kernels forward_cpu / _cuda run

logger = logging.getLogger("vllm_mla")
BASE_MODULE = "vllm.model_executor.layers.sparse_attn_indexer"
# Bytes per (token, position) score while selecting: the fp32 logit and the top-k's
# int64 key, its order and the gathered result (``ops.sparse_indexer.api.select_topk``).
TOPK_BYTES_PER_SCORE = 4 + 3 * 8
_registered: str | None = None


def vllm_indexer_runs(device: torch.device | None = None) -> tuple[bool, str]:
    """(whether vLLM 0.33's CUDA indexer can run here, why not)."""
    from vllm.utils.deep_gemm import is_deep_gemm_supported

    if not is_deep_gemm_supported():
        return False, "DeepGEMM is not available (vLLM's CUDA indexer needs it)"
    major, _ = torch.cuda.get_device_capability(device)
    if major == 12:
        return False, "SM12x: vLLM's top-k fallback needs more shared memory than ~99 KiB"
    return True, ""


def ours_on_cuda() -> tuple[bool, str]:
    """(whether the CUDA indexer is ours, why) under ``VLLM_MLA_INDEXER``."""
    choice = envs.indexer_choice()
    if choice != "auto":
        return choice == "ours", f"VLLM_MLA_INDEXER={choice}"
    runs, why = vllm_indexer_runs()
    return (not runs), (why or "vLLM's indexer runs here")


# -- one step's tokens: which rows, whose block table, how long a context -----------------
def step_contexts(meta: object) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Per group of tokens the indexer scores this step (decode first, then each prefill
    chunk): ``(rows int64 [n], block-table rows int32 [n, W], causal lengths int32 [n],
    bound)`` with ``bound`` a host-side upper bound of the lengths (decode: the
    metadata's ``max_seq_len``; prefill: the chunk's ``max_seqlen_k`` on vLLM 0.33, the
    step's ``max_seq_len`` on 0.32, which has no per-chunk bound). Tensor ops only: no
    host sync."""
    groups = []
    decode = meta.decode
    if meta.num_decodes and decode is not None:
        groups.append((*_decode_tokens(decode, meta.num_decode_tokens), int(meta.max_seq_len)))
    prefill = meta.prefill
    if meta.num_prefills and prefill is not None:
        for chunk in prefill.chunks:
            n = chunk.token_end - chunk.token_start
            ks, ke = chunk.cu_seqlen_ks[:n], chunk.cu_seqlen_ke[:n]
            request = torch.searchsorted(chunk.cu_seq_lens.long(), ks.long(), right=True) - 1
            rows = torch.arange(chunk.token_start, chunk.token_end, device=ks.device)
            lengths = (ke - ks).to(torch.int32)
            # vLLM 0.33 states the chunk's bound; 0.32 has only the step's max_seq_len
            bound = getattr(chunk, "max_seqlen_k", None) or meta.max_seq_len
            groups.append((rows, chunk.block_table[request], lengths, int(bound)))
    return groups


def _decode_tokens(decode: object, num_tokens: int) -> tuple[torch.Tensor, ...]:
    """(rows, block-table rows, causal lengths) of the decode tokens, in every layout vLLM's
    indexer metadata builder hands over (tensor ops only: no host sync):

    - ``seq_lens`` 1-D: one row per token (plain decode; speculative decoding flattened per
      token, each row with its own block-table row);
    - ``seq_lens`` 2-D ``[B, n]`` (native speculative decoding, ``n`` the step's longest
      draft + 1), ``[b, j] = L_b - n + j + 1``: request ``b``'s tokens are consecutive rows;
    - the same with ``requires_padding`` (requests of fewer tokens, e.g. the zero-length
      ones CUDA-graph padding adds): request ``b`` brings ``decode_lens[b]`` packed tokens,
      token ``i`` of it attends to ``L_b - decode_lens[b] + 1 + i`` keys, column
      ``n - decode_lens[b] + i`` of its row; rows past the requests' tokens get length 0.
      Read by column, not computed from ``L_b``: under DCP vLLM localizes every column to
      this rank's shard on its own (``_dcp_localize_decode_seq_lens``), and a rank's local
      lengths are not consecutive integers.
    """
    seq = decode.seq_lens
    if seq.dim() == 1:
        rows = torch.arange(seq.shape[0], device=seq.device)
        return rows, decode.block_table[: seq.shape[0]], seq.to(torch.int32)
    requests, width = seq.shape
    if not decode.requires_padding:
        rows = torch.arange(requests * width, device=seq.device)
        tables = decode.block_table[:requests].repeat_interleave(width, dim=0)
        return rows, tables, seq.reshape(-1).to(torch.int32)
    lens = decode.decode_lens[:requests].long()
    ends = torch.cumsum(lens, 0)
    rows = torch.arange(num_tokens, device=seq.device)
    owner = torch.searchsorted(ends, rows, right=True).clamp_max(requests - 1)
    position = rows - (ends - lens)[owner]
    column = (width - lens[owner] + position).clamp(0, width - 1)  # clamped: padding rows
    lengths = torch.where(rows < ends[-1], seq[owner, column].long().clamp_min(0), 0)
    return rows, decode.block_table[owner], lengths.to(torch.int32)


def _insert_step_keys(layer: object, k: torch.Tensor | None, meta: object, kernels: object):
    """Insert this step's index keys into the layer's cache (slot -1: not this rank's, or
    padding); returns the cache."""
    cache = layer.k_cache.kv_cache
    slots = meta.slot_mapping
    if k is not None:
        kernels.insert_keys(cache, k[: slots.shape[0]], slots, ue8m0=layer.scale_fmt == "ue8m0")
    return cache


def _row_blocks(
    rows: int, width: int, budget_bytes: int | None, per_score: int
) -> list[tuple[int, int]]:
    """(start, size) of the row blocks whose ``width`` scores of ``per_score`` bytes each
    fit ``budget_bytes`` (all rows at once without a budget); sized on the host."""
    block = rows if budget_bytes is None else max(1, budget_bytes // (per_score * max(width, 1)))
    return [(start, block) for start in range(0, rows, max(block, 1))]


def select(
    layer: object,
    hidden_states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    weights: torch.Tensor,
    meta: object,
    kernels: object,
    max_decode_len: int | None = None,
    budget_bytes: int | None = None,
) -> torch.Tensor:
    """Insert this step's index keys, then write every scored token's top-k (request-local
    positions, -1 padded) into ``layer.topk_indices_buffer``; returns the buffer.

    ``max_decode_len``: the decode logits' width (``max_model_len`` for a static shape
    under CUDA graphs); None: the step's ``max_seq_len``. ``budget_bytes``: at most this
    many bytes of logits and top-k temporaries at once (``TOPK_BYTES_PER_SCORE`` per
    score), so groups are split into row blocks sized on the host (no sync).
    """
    cache = _insert_step_keys(layer, k, meta, kernels)
    buffer = layer.topk_indices_buffer
    buffer[: hidden_states.shape[0]] = -1
    # Gather e4m3 rows as bytes: fp8 indexing is not implemented on every device.
    q_rows = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
    for i, (rows, tables, lengths, bound) in enumerate(step_contexts(meta)):
        width = max_decode_len if (i == 0 and meta.num_decodes and max_decode_len) else bound
        for start, block in _row_blocks(rows.shape[0], width, budget_bytes, TOPK_BYTES_PER_SCORE):
            part = rows[start : start + block]
            buffer[part] = kernels.index_topk(
                q_rows[part].view(q.dtype),
                weights[part],
                cache,
                tables[start : start + block],
                lengths[start : start + block],
                layer.topk_tokens,
                max_len=width,
            )
    return buffer


# -- decode context parallelism ---------------------------------------------------------
def dcp_contexts(
    meta: object, shard: DCPShard
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """``step_contexts`` under DCP: per group of scored tokens ``(rows, block-table rows
    of this rank, this rank's causal lengths, a host bound of them)``.

    vLLM's indexer metadata builder localizes what a rank scores: decode ``seq_lens``
    are this rank's per-token lengths (``global_seq_lens`` the group's), a prefill
    chunk's ``cu_seqlen_ks``/``ke`` this rank's row bounds (``local_cu_seq_lens`` its
    request starts; ``cu_seq_lens`` stays the group's). A request with no row here
    repeats the previous start, so the token's request is the last one starting at or
    before its start, clamped (a repeated start only ever names a zero-length request,
    whose tokens score nothing).
    """
    groups = []
    decode = meta.decode
    bound = shard.local_bound(int(meta.max_seq_len))
    if meta.num_decodes and decode is not None:
        # every layout of step_contexts: vLLM localized each token's length already
        groups.append((*_decode_tokens(decode, meta.num_decode_tokens), bound))
    prefill = meta.prefill
    if meta.num_prefills and prefill is not None:
        for chunk in prefill.chunks:
            n = chunk.token_end - chunk.token_start
            ks, ke = chunk.cu_seqlen_ks[:n], chunk.cu_seqlen_ke[:n]
            starts = chunk.local_cu_seq_lens[: chunk.num_reqs].long()
            request = torch.searchsorted(starts, ks.long(), right=True) - 1
            request = request.clamp(0, chunk.num_reqs - 1)
            rows = torch.arange(chunk.token_start, chunk.token_end, device=ks.device)
            groups.append((rows, chunk.block_table[request], (ke - ks).to(torch.int32), bound))
    return groups


def select_dcp(
    layer: object,
    hidden_states: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    weights: torch.Tensor,
    meta: object,
    kernels: object,
    shard: DCPShard,
    group: object,
    max_decode_len: int | None = None,
    budget_bytes: int | None = None,
) -> torch.Tensor:
    """``select`` under DCP: the same selection as one rank holding everything.

    Inserts the keys this rank holds (vLLM's slot mapping gives the others -1), scores
    each token against this rank's shard (``kernels.paged_logits``), keeps the local
    top-K as (logit, request position) keys (``ops.sparse_indexer.dcp``), all-gathers
    them over the DCP ``group`` (one int64 ``[N, T, K]``, the same shape on every rank)
    and writes every token's global top-K, request positions of the whole group (the
    attention impl keeps the ones its shard holds), into ``layer.topk_indices_buffer``.
    ``max_decode_len``/``budget_bytes``: as ``select``'s, of the group's positions.
    """
    from vllm_mla.ops.sparse_indexer import dcp as dcp_topk

    cache = _insert_step_keys(layer, k, meta, kernels)
    topk = layer.topk_tokens
    tokens = hidden_states.shape[0]
    keys = torch.full((tokens, topk), dcp_topk.EMPTY_KEY, dtype=torch.int64, device=q.device)
    q_rows = q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q
    decode_width = None if max_decode_len is None else shard.local_bound(max_decode_len)
    for i, (rows, tables, lengths, bound) in enumerate(dcp_contexts(meta, shard)):
        width = decode_width if (i == 0 and meta.num_decodes and decode_width) else bound
        per_score = TOPK_BYTES_PER_SCORE + 8  # + the int64 candidate key
        for start, block in _row_blocks(rows.shape[0], width, budget_bytes, per_score):
            part = rows[start : start + block]
            scores = kernels.paged_logits(
                q_rows[part].view(q.dtype),
                weights[part],
                cache,
                tables[start : start + block],
                lengths[start : start + block],
                max_len=width,
            )
            keys[part] = dcp_topk.candidate_keys(
                scores, lengths[start : start + block], topk, shard
            )
    gathered = group.all_gather(keys, dim=0).view(shard.size, tokens, topk)
    buffer = layer.topk_indices_buffer
    buffer[:tokens] = dcp_topk.merge_candidates(gathered, topk)
    return buffer


def _forward_context_metadata(layer: object) -> object | None:
    from vllm.forward_context import get_forward_context

    attn_metadata = get_forward_context().attn_metadata
    if not isinstance(attn_metadata, dict):
        return None  # profile / dummy run: nothing to select
    return attn_metadata.get(layer.k_cache.prefix)


def _delegates(layer: object) -> bool:
    """DeepSeek-V4 indexers and prefill context parallelism: vLLM's own methods serve
    them (DCP is ours: ``select_dcp``)."""
    return bool(
        layer.skip_k_cache_insert
        or layer.use_fp4_cache
        or layer.candidate_blocks is not None
        or layer.use_pcp
    )


def _dcp_of(layer: object) -> DCPShard:
    """The indexer's DCP shard (its interleave read now, from vLLM's parallel config)."""
    if layer.dcp_world_size <= 1:
        return NO_DCP
    parallel = layer.vllm_mla_parallel
    interleave = int(getattr(parallel, "cp_kv_cache_interleave_size", 1))
    return DCPShard(int(layer.dcp_world_size), int(layer.dcp_rank), interleave)


def _logits_budget() -> int:
    """``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`` in bytes: vLLM's bound on indexer logits."""
    from vllm import envs as vllm_envs

    return vllm_envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB << 20


def _reserve_logits_peak(device: torch.device) -> None:
    """A transient of the logits budget during the profile run (vLLM's own indexer
    reserves the same), so the KV cache is sized with it free; ``select`` keeps its
    logits and top-k temporaries within it."""
    torch.empty(_logits_budget(), dtype=torch.uint8, device=device)


@contextlib.contextmanager
def _deep_gemm_guard_lifted(module: ModuleType):
    """vLLM's constructor with its DeepGEMM guard answering True (module docstring)."""
    original = module.has_deep_gemm
    module.has_deep_gemm = lambda: True
    try:
        yield
    finally:
        module.has_deep_gemm = original


def make_indexer() -> type:
    """``PortableSparseAttnIndexer``: vLLM's SparseAttnIndexer with our CPU and CUDA paths."""
    import importlib

    module = importlib.import_module(BASE_MODULE)
    base = module.SparseAttnIndexer

    class PortableSparseAttnIndexer(base):
        """vLLM's DSA indexer op; ours selects where vLLM's cannot (module docstring)."""

        def __init__(self, *args, **kwargs):
            from vllm.platforms import current_platform

            self_ours = current_platform.is_cuda() and ours_on_cuda()[0]
            guard = _deep_gemm_guard_lifted(module) if self_ours else contextlib.nullcontext()
            with guard:
                super().__init__(*args, **kwargs)
            self.vllm_mla_ours = self_ours and not _delegates(self)
            from vllm.config import get_current_vllm_config_or_none

            config = get_current_vllm_config_or_none()  # its interleave is read later
            self.vllm_mla_parallel = None if config is None else config.parallel_config
            self.vllm_mla_dcp: DCPShard | None = None  # resolved at the first step

        def _vllm_mla_shard(self) -> DCPShard:
            shard = self.vllm_mla_dcp
            if shard is None:
                shard = self.vllm_mla_dcp = _dcp_of(self)
            return shard

        def _vllm_mla_select_dcp(self, hidden_states, q_quant, k, weights, meta, kernels, **kw):
            from vllm.distributed import get_dcp_group

            shard, group = self._vllm_mla_shard(), get_dcp_group()
            return select_dcp(
                self, hidden_states, q_quant, k, weights, meta, kernels, shard, group, **kw
            )

        def forward_cuda(self, hidden_states, q_quant, k, weights):
            if not self.vllm_mla_ours:
                return super().forward_cuda(hidden_states, q_quant, k, weights)
            meta = _forward_context_metadata(self)
            if meta is None:  # profile run: the logits peak, as vLLM's indexer reserves it
                _reserve_logits_peak(hidden_states.device)
                return self.topk_indices_buffer
            sizes = {"max_decode_len": self.max_model_len, "budget_bytes": _logits_budget()}
            args = (hidden_states, q_quant, k, weights, meta, kernels_for(CUDA))
            if self.dcp_world_size > 1:
                telemetry.record_sparse("indexer:triton:dcp")
                return self._vllm_mla_select_dcp(*args, **sizes)
            telemetry.record_sparse("indexer:triton")
            return select(self, *args, **sizes)

        def forward_cpu(self, hidden_states, q_quant, k, weights):
            if _delegates(self):
                return super().forward_cpu(hidden_states, q_quant, k, weights)
            meta = _forward_context_metadata(self)
            if meta is None:
                return self.topk_indices_buffer
            if self.dcp_world_size > 1:
                telemetry.record_sparse("indexer:cpu:dcp")
                return self._vllm_mla_select_dcp(
                    hidden_states, q_quant, k, weights, meta, kernels_for(CPU)
                )
            telemetry.record_sparse("indexer:cpu")
            return select(self, hidden_states, q_quant, k, weights, meta, kernels_for(CPU))

    PortableSparseAttnIndexer.__qualname__ = "PortableSparseAttnIndexer"
    return PortableSparseAttnIndexer


def register(platform: str) -> str:
    """Install the portable indexer (once per process); what happened, for the log.

    ``platform``: ``"cpu"`` (feature ``sparse-cpu``) or ``"cuda"`` (feature
    ``sparse-indexer``, only when ``VLLM_MLA_INDEXER`` resolves to ours).
    """
    global _registered
    from vllm.model_executor.custom_op import op_registry_oot

    if platform == "cuda":
        ours, why = ours_on_cuda()
        if not ours:
            return f"vLLM's DSA indexer kept ({why})"
    import importlib

    base = importlib.import_module(BASE_MODULE).SparseAttnIndexer
    if base.__name__ in op_registry_oot:
        owner = op_registry_oot[base.__name__]
        if getattr(owner, "__qualname__", "") != "PortableSparseAttnIndexer":
            return f"DSA indexer left to {owner.__module__}.{owner.__qualname__}"
        return "portable DSA indexer (already)"
    base.register_oot(make_indexer())
    _registered = f"registered the portable DSA indexer (SparseAttnIndexer.register_oot, {platform}"
    if platform == "cuda":
        _registered += f": {ours_on_cuda()[1]}"
    _registered += ")"
    return _registered


__all__ = [
    "ReferenceKernels",
    "dcp_contexts",
    "make_indexer",
    "ours_on_cuda",
    "register",
    "select",
    "select_dcp",
    "step_contexts",
]
