"""Plain-torch kpool indexer of GLM-5.3-Flash (``Glm5NextForCausalLM``): the oracle.

Numeric contract (vLLM 0.33 ``vllm/models/glm5next``: ``common/attention.py``
``Indexer.forward``, ``nvidia/sparse_indexer.py`` ``sparse_attn_indexer_kpool``,
``nvidia/ops/kpool_compress.py``; transformers 5.20 ``Glm5NextTextIndexer`` computes the
same selection unquantized):

- **Hadamard-128** ``hadamard128``: the Sylvester transform ``H[i, j] = (-1) **
  popcount(i & j) / sqrt(128)`` as fp32 butterflies (strides 1, 2, ..., 64, then one
  multiply by the fp32 ``1 / sqrt(128)``), the order vLLM's ``_hadamard128`` sums in.
  ``H`` is orthogonal and symmetric, so ``Hq . Hk == q . k``: the rotation only spreads
  outliers before the fp8 cast (transformers, unquantized, leaves it out).
- **Query** ``quantize_query``: ``q [T, H, 128]`` -> rotate in fp32 -> bf16 -> per (token,
  head) row ``scale = 2 ** ceil(log2(max(amax, 1e-4) / E4M3_MAX))``, ``e4m3(x / scale)``
  (``fwht128_quant_fp8``). ``fold_weights``: ``weights[t, h] * q_scale[t, h] *
  (128 ** -0.5 * H ** -0.5)`` in fp32 (``_fused_indexer_weight_scale``; ``H`` the real
  head count, before vLLM zero-pads heads to 32 for DeepGEMM, which adds nothing).
- **Pool compression** ``compress_pools``: pool ``g`` of a request is its tokens ``g*kpool
  .. g*kpool + kpool - 1``; per channel ``p_s = softmax_s(gate[s] + ape[s])`` (fp32, max
  subtracted, slots summed in order), ``x = sum_s p_s k[s] / sum_s p_s`` -> bf16 ->
  Hadamard -> bf16 (``_kpool_softmax_rotate_write_cache_kernel``). Only complete pools
  exist; ``quantize_pools`` / ``insert_pools`` store them like V3.2 index keys (floor 1e-4,
  ue8m0 when ``round_scale``; same ``[num_blocks, block_size, 132]`` page layout, one row
  per pool: ``vllm_mla.ops.sparse_indexer.reference``).
- **Pool slots** ``compressed_slot_mapping``: the token at position ``p`` writes pool ``p //
  kpool`` iff ``(p + 1) % kpool == 0``, at ``table[(p // kpool) // bs] * bs + (p // kpool) %
  bs`` (``CompressedSlotMappingKernel``, no DCP); every other token -1.
- **Tail ring** ``decode_step``: ``[num_blocks, 2, ring, 128]`` bf16 (K, gate), ``ring`` a
  multiple of ``kpool``; a decode token first completes its pool (``p % kpool == kpool-1``
  and a pool slot >= 0) from the ring's ``kpool - 1`` earlier entries and itself, then
  stashes itself at ``p % ring`` (``_kpool_decode_update_batched_kernel``).
- **Pool logits**: ``k_scale[g] * sum_h w[t, h] * relu(q[t, h] . k[g])`` in fp32 over the
  ``L_t // kpool`` complete pools of a token with causal length ``L_t = pos + 1`` (the
  indexer's pool-granular lengths), the V3.2 formula (``sparse_indexer.reference.logits``).
- **Top-k over pools**: ``topk // kpool`` pools (``topk % kpool == 0``), the V3.2 rule
  (``select_topk``: largest first, ties toward the lower pool, -1 past the pools there
  are). vLLM's kernels and ``torch.topk`` leave tie order unstated; only sets compare.
- **Expansion** ``expand_pools_and_tail``: column ``c < topk`` is ``pool[c // kpool] *
  kpool + c % kpool`` (-1 for a -1 pool); columns ``topk .. topk + kpool - 2`` hold the
  tail ``L - L % kpool + j`` for ``j < L % kpool``, else -1; the row is ``output_width =
  round_up(topk + kpool - 1, 128)`` wide, -1 past the tail (vLLM's ``topk_indices_buffer``,
  ``get_sparse_topk_buffer_width``). vLLM writes rows of short contexts (``L <= topk``) as
  ``0 .. L-1`` in order instead (``_fill_causal_indices``): the same set (every pool is
  selected) in another layout.
"""

from __future__ import annotations

import torch

from vllm_mla.formats import INDEX_HEAD_DIM, TOPK_BUFFER_ALIGN
from vllm_mla.ops.sparse_indexer import reference as dsa
from vllm_mla.ops.sparse_indexer.reference import AMAX_FLOOR, IndexerError, quantize_rows

HADAMARD_SCALE = 0.08838834764831845  # 1 / sqrt(128), as vLLM's kernels write it (fp32)


def _describe(x: object) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{x.dtype} {tuple(x.shape)} on {x.device}"


def expect(name: str, ok: bool, expected: str, got: object) -> None:
    """Raise ``IndexerError`` naming the argument, what it should be and what it is."""
    if not ok:
        raise IndexerError(f"{name}: expected {expected}, got {got}")


def check_kpool(kpool: object, topk: object | None = None) -> None:
    expect("kpool", isinstance(kpool, int) and kpool >= 1, "an int >= 1", kpool)
    if topk is not None:
        ok = isinstance(topk, int) and topk >= kpool and topk % kpool == 0
        expect("topk", ok, f"a positive multiple of kpool={kpool}", topk)


def buffer_width(topk: int, kpool: int) -> int:
    """``topk + kpool - 1`` (history + tail) rounded up to ``TOPK_BUFFER_ALIGN`` (128, the
    sparse-MLA tiles), unchecked: vLLM's ``get_sparse_topk_buffer_width``."""
    return -(-(topk + kpool - 1) // TOPK_BUFFER_ALIGN) * TOPK_BUFFER_ALIGN


def output_width(topk: int, kpool: int) -> int:
    """The top-k row width (``buffer_width``) of a checked ``topk`` / ``kpool``."""
    check_kpool(kpool, topk)
    return buffer_width(topk, kpool)


# -- rotation and quantization ----------------------------------------------------------
def hadamard128(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x @ H`` over the last dim (128), butterflies in vLLM's order."""
    expect("x", x.shape[-1] == INDEX_HEAD_DIM, f"last dim {INDEX_HEAD_DIM}", _describe(x))
    lead = x.shape[:-1]
    y = x.float().reshape(-1, INDEX_HEAD_DIM)
    stride = 1
    while stride < INDEX_HEAD_DIM:
        # explicit sizes, not -1: zero rows (no complete pool yet) reshape too
        pairs = y.reshape(y.shape[0], INDEX_HEAD_DIM // (2 * stride), 2, stride)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(y.shape[0], INDEX_HEAD_DIM)
        stride *= 2
    return (y * HADAMARD_SCALE).reshape(*lead, INDEX_HEAD_DIM)


def rotate_query(q: torch.Tensor) -> torch.Tensor:
    """bf16 ``H q`` per 128-row (before the fp8 cast)."""
    return hadamard128(q).to(torch.bfloat16)


def quantize_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [T, H, 128], fp32 scales [T, H])`` of ``q [T, H, 128]``: rotate, bf16,
    ue8m0 row quantization with floor 1e-4 (``fwht128_quant_fp8``)."""
    expect("q", q.dim() == 3 and q.is_floating_point(), "a float [T, H, 128]", _describe(q))
    return quantize_rows(rotate_query(q), ue8m0=True, floor=AMAX_FLOOR)


def fold_weights(weights: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, H]``: ``weights * q_scale * (128**-0.5 * H**-0.5)`` (what the logits use)."""
    expect("weights", weights.dim() == 2, "[T, H]", _describe(weights))
    expect("q_scale", q_scale.shape == weights.shape, f"shape {tuple(weights.shape)}", q_scale)
    scale = INDEX_HEAD_DIM**-0.5 * weights.shape[1] ** -0.5
    return weights.float() * q_scale.float() * scale


# -- pool compression -------------------------------------------------------------------
def _check_pool_inputs(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> int:
    ok = isinstance(k, torch.Tensor) and k.dim() == 3 and k.shape[-1] == INDEX_HEAD_DIM
    expect("k", ok and k.is_floating_point(), f"a float [P, kpool, {INDEX_HEAD_DIM}]", _describe(k))
    ok = isinstance(gate, torch.Tensor) and gate.shape == k.shape and gate.is_floating_point()
    expect("gate", ok, f"a float tensor of k's shape {tuple(k.shape)}", _describe(gate))
    kpool = k.shape[1]
    ok = isinstance(ape, torch.Tensor) and ape.shape == (kpool, INDEX_HEAD_DIM)
    expect(
        "ape",
        ok and ape.dtype == torch.float32,
        f"fp32 [{kpool}, {INDEX_HEAD_DIM}]",
        _describe(ape),
    )
    expect(
        "gate", gate.device == k.device == ape.device, f"every tensor on {k.device}", gate.device
    )
    return kpool


def pool_mean(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """fp32 ``[P, 128]``: per channel the softmax(gate + ape)-weighted mean of each pool's
    keys, ``k/gate [P, kpool, 128]``, ``ape [kpool, 128]``; slots summed in order."""
    kpool = _check_pool_inputs(k, gate, ape)
    score = gate.float() + ape[None]
    peak = score.amax(dim=1)
    acc = torch.zeros_like(peak)
    denom = torch.zeros_like(peak)
    for s in range(kpool):
        prob = torch.exp(score[:, s] - peak)
        denom = denom + prob
        acc = acc + k[:, s].float() * prob
    return acc / denom


def compress_pools(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """bf16 ``[P, 128]`` pool keys, rotated, before the fp8 cast: pool mean -> bf16 ->
    Hadamard -> bf16."""
    x = pool_mean(k, gate, ape).to(torch.bfloat16)
    return hadamard128(x).to(torch.bfloat16)


def quantize_pools(rotated: torch.Tensor, *, round_scale: bool = True):
    """``(e4m3 [P, 128], fp32 [P])``: the cache's values and scales (floor 1e-4)."""
    return quantize_rows(rotated, ue8m0=round_scale, floor=AMAX_FLOOR)


def request_pools(k: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """``compress_pools`` of a request's tokens ``0 .. L-1`` (``k/gate [L, 128]``): its
    ``L // kpool`` complete pools (the incomplete tail is not pooled)."""
    kpool = ape.shape[0]
    n = k.shape[0] // kpool * kpool
    expect("gate", gate.shape == k.shape, f"k's shape {tuple(k.shape)}", _describe(gate))
    view = (n // kpool, kpool, k.shape[-1])
    return compress_pools(k[:n].reshape(view), gate[:n].reshape(view), ape)


insert_pools = dsa.insert_keys  # one pool per index-cache row, V3.2's layout and quantization


# -- slots ------------------------------------------------------------------------------
def compressed_slot_mapping(
    positions: torch.Tensor, tables: torch.Tensor, block_size: int, kpool: int
) -> torch.Tensor:
    """int64 ``[T]``: the pool-cache slot each token writes (the last token of a pool), -1
    for the others; ``tables [T, W]`` the block-table row of each token's request."""
    check_kpool(kpool)
    pos = positions.long()
    pool = pos // kpool
    table_col = (pool // block_size).clamp(0, tables.shape[1] - 1)
    page = tables.long().gather(1, table_col[:, None])[:, 0]
    slot = page * block_size + pool % block_size
    return torch.where((pos >= 0) & ((pos + 1) % kpool == 0), slot, -1)


def decode_step(
    pool_cache: torch.Tensor,
    tail_cache: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    positions: torch.Tensor,
    pool_slots: torch.Tensor,
    tail_slots: torch.Tensor,
    *,
    round_scale: bool = True,
) -> None:
    """One request's decode tokens in position order: complete pools from the tail ring,
    then stash each token (``tail_cache [nb, 2, ring, 128]`` bf16; ``tail_slots[t] = block
    * ring + pos % ring``, < 0: no stash; ``pool_slots`` from ``compressed_slot_mapping``)."""
    kpool = ape.shape[0]
    expect(
        "tail_cache",
        tail_cache.dim() == 4 and tail_cache.shape[1] == 2,
        "[nb, 2, ring, 128]",
        _describe(tail_cache),
    )
    ring = tail_cache.shape[2]
    expect("tail_cache", ring % kpool == 0, f"a ring that is a multiple of kpool={kpool}", ring)
    expect("tail_cache", tail_cache.dtype == torch.bfloat16, "bf16", tail_cache.dtype)
    for t in range(positions.shape[0]):
        pos, tslot, pslot = int(positions[t]), int(tail_slots[t]), int(pool_slots[t])
        if pos < 0:
            continue
        block = max(tslot, 0) // ring
        if pslot >= 0 and pos % kpool == kpool - 1:
            phys = [(pos - kpool + 1 + s) % ring for s in range(kpool - 1)]
            pool_k = torch.cat([tail_cache[block, 0, phys], k[t : t + 1].to(torch.bfloat16)])
            pool_g = torch.cat([tail_cache[block, 1, phys], gate[t : t + 1].to(torch.bfloat16)])
            rotated = compress_pools(pool_k[None], pool_g[None], ape)
            slot = torch.tensor([pslot], device=pool_cache.device)
            insert_pools(pool_cache, rotated, slot, ue8m0=round_scale)
        if tslot >= 0:
            tail_cache[block, 0, pos % ring] = k[t].to(torch.bfloat16)
            tail_cache[block, 1, pos % ring] = gate[t].to(torch.bfloat16)


# -- selection --------------------------------------------------------------------------
logits = dsa.logits  # k_scale[g] * sum_h w[t, h] * relu(q[t, h] . k[g]), fp32
select_pools = dsa.select_topk  # largest first, ties toward the lower pool, -1 padded


def expand_pools_and_tail(
    pool_ids: torch.Tensor, seq_lens: torch.Tensor, kpool: int, width: int | None = None
) -> torch.Tensor:
    """int32 ``[T, width]`` token indices: the selected pools' tokens, then the tail
    ``[L - L % kpool, L)``, -1 elsewhere; ``width`` defaults to ``output_width``."""
    check_kpool(kpool)
    ok = (
        isinstance(pool_ids, torch.Tensor)
        and pool_ids.dim() == 2
        and not pool_ids.is_floating_point()
    )
    expect("pool_ids", ok, "an integer [T, topk // kpool]", _describe(pool_ids))
    rows, groups = pool_ids.shape
    topk = groups * kpool
    ok = isinstance(seq_lens, torch.Tensor) and tuple(seq_lens.shape) == (rows,)
    expect(
        "seq_lens",
        ok and not seq_lens.is_floating_point(),
        f"an integer [{rows}]",
        _describe(seq_lens),
    )
    need = topk + kpool - 1
    width = output_width(topk, kpool) if width is None else width
    expect(
        "width",
        isinstance(width, int) and width >= need,
        f"an int >= topk + kpool - 1 = {need}",
        width,
    )
    ids = pool_ids.long()
    hist = ids[:, :, None] * kpool + torch.arange(kpool, device=ids.device)
    hist = torch.where(ids[:, :, None] >= 0, hist, -1).reshape(rows, topk)
    lens = seq_lens.long()
    tail_count = lens.clamp_min(0) % kpool
    offs = torch.arange(kpool - 1, device=ids.device)
    tail = torch.where(offs[None] < tail_count[:, None], (lens - tail_count)[:, None] + offs, -1)
    out = torch.full((rows, width), -1, dtype=torch.int32, device=ids.device)
    out[:, :need] = torch.cat([hist, tail], dim=1).to(torch.int32)
    return out


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    kpool: int,
    *,
    width: int | None = None,
) -> torch.Tensor:
    """int32 ``[T, width]`` request-local token indices for ``T`` tokens.

    ``q [T, H, 128]`` (rotated, e4m3 or float), ``weights [T, H]`` folded
    (``fold_weights``), ``cache`` the pool cache, ``block_tables [T, W]`` each token's
    request's pool-cache table row, ``seq_lens [T]`` token-granular causal lengths (pos+1).
    """
    check_kpool(kpool, topk)
    dsa._check_index("seq_lens", seq_lens, 1, q.device)
    expect("seq_lens", seq_lens.shape[0] == q.shape[0], f"[T={q.shape[0]}]", _describe(seq_lens))
    pool_counts = seq_lens.long().clamp_min(0) // kpool
    pool_ids = dsa.index_topk(q, weights, cache, block_tables, pool_counts, topk // kpool)
    return expand_pools_and_tail(pool_ids, seq_lens, kpool, width)


def dense_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    topk: int,
    *,
    quantize: bool = True,
    width: int | None = None,
) -> torch.Tensor:
    """One request's prefill from position 0, from the indexer's raw inputs (``q [T, H,
    128]`` unrotated, ``weights [T, H]`` the ``weights_proj`` output, ``k/gate [T, 128]``,
    ``ape [kpool, 128]``): int32 ``[T, width]``. ``quantize=False``: fp32 throughout, no
    rotation or fp8 (the computation transformers' indexer writes down)."""
    kpool = ape.shape[0]
    check_kpool(kpool, topk)
    t, heads, _ = q.shape
    seq_lens = torch.arange(1, t + 1, device=q.device)
    if quantize:
        qv, q_scale = quantize_query(q)
        w = fold_weights(weights, q_scale)
        pk, pk_scale = quantize_pools(request_pools(k, gate, ape))
    else:
        qv = q.float()
        w = weights.float() * (INDEX_HEAD_DIM**-0.5 * heads**-0.5)
        view = (t // kpool, kpool, INDEX_HEAD_DIM)
        n = t // kpool * kpool
        pk = pool_mean(k[:n].reshape(view), gate[:n].reshape(view), ape)
        pk_scale = torch.ones(pk.shape[0], device=q.device)
    scores = logits(qv.float(), w, pk.float(), pk_scale)
    pool_ids = select_pools(scores, seq_lens // kpool, topk // kpool)
    return expand_pools_and_tail(pool_ids, seq_lens, kpool, width)


__all__ = [
    "HADAMARD_SCALE",
    "IndexerError",
    "buffer_width",
    "compress_pools",
    "compressed_slot_mapping",
    "decode_step",
    "dense_topk",
    "expand_pools_and_tail",
    "fold_weights",
    "hadamard128",
    "index_topk",
    "insert_pools",
    "logits",
    "output_width",
    "pool_mean",
    "quantize_pools",
    "quantize_query",
    "request_pools",
    "rotate_query",
    "select_pools",
]
