"""Plain-torch DSA lightning indexer: index-key cache, logits and top-k (the oracle).

Numeric contract (vLLM 0.32/0.33's ``SparseAttnIndexer`` for DeepSeek-V3.2 / GLM-5):

- **Row quantization** (keys on insert, queries per head): ``scale = max(amax, floor) /
  448`` in float32 (``floor`` 1e-4 for keys, vLLM's ``eps`` 1e-10 for queries); with
  ``ue8m0`` (``scale_fmt == "ue8m0"``, DeepSeek-V3.2's) ``scale = 2 ** ceil(log2(scale))``;
  values ``e4m3(x / scale)``.
- **Index-key cache** ``[num_blocks, block_size, 132]`` uint8, read per page: the page's
  first ``block_size * 128`` bytes are the keys' e4m3 values (token-major), then
  ``block_size`` float32 scales. Physical row ``r`` is page ``r // block_size``, slot
  ``r % block_size``; negative slots are not written.
- **Logits** of token ``t`` against key ``j``: ``k_scale[j] * sum_h w[t, h] *
  relu(q[t, h] . k[j])`` in float32 (``w`` already folds the query scales, the softmax
  scale and ``1 / sqrt(heads)``, as vLLM's indexer passes it).
- **Top-k** over the ``L_t`` causal positions of the token's own request: the ``K``
  largest logits, ties broken toward the lower position, written as request-local
  positions in descending logit order, ``-1`` past ``min(K, L_t)``.
"""

from __future__ import annotations

import torch

from vllm_mla.formats import E4M3_MAX, INDEX_HEAD_DIM, INDEX_RECORD_BYTES

SCALE_BYTES = 4  # one float32 scale per key
RECORD_BYTES = INDEX_RECORD_BYTES  # 132: the cache's last dim
AMAX_FLOOR = 1e-4


class IndexerError(ValueError):
    """An indexer argument does not match the contract (names it: expected vs actual)."""


def quantize_rows(
    x: torch.Tensor, *, ue8m0: bool = True, floor: float = AMAX_FLOOR
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 values like x, float32 scales x.shape[:-1])``: one scale per last-dim row,
    ``max(amax, floor) / 448`` (keys use vLLM's 1e-4; queries its ``eps``, 1e-10)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=floor) / E4M3_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    values = (xf / scale[..., None]).to(torch.float8_e4m3fn)
    return values, scale


def _describe(x: object) -> str:
    if not isinstance(x, torch.Tensor):
        return type(x).__name__
    return f"{x.dtype} {tuple(x.shape)} on {x.device}"


def _check_cache(cache: torch.Tensor) -> None:
    ok = isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8 and cache.dim() == 3
    if not ok or cache.shape[-1] != RECORD_BYTES:
        raise IndexerError(
            f"index-key cache: expected uint8 [num_blocks, block_size, {RECORD_BYTES}], "
            f"got {_describe(cache)}"
        )
    if cache.stride(2) != 1 or cache.stride(1) != RECORD_BYTES:
        raise IndexerError(f"index-key cache: pages must be contiguous, strides {cache.stride()}")
    # The scales are read as float32 views of each page: 4-byte aligned offsets only.
    if cache.storage_offset() % SCALE_BYTES or cache.stride(0) % SCALE_BYTES:
        raise IndexerError(
            f"index-key cache: expected a storage offset and page stride that are multiples "
            f"of {SCALE_BYTES}, got offset {cache.storage_offset()}, strides {cache.stride()}"
        )


def _check_index(name: str, x: object, dims: int, device: torch.device) -> torch.Tensor:
    """``x`` is an integer tensor of rank ``dims`` on ``device``."""
    ok = isinstance(x, torch.Tensor) and x.dim() == dims and x.device == device
    if not ok or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise IndexerError(
            f"{name}: expected a {dims}-D integer tensor on {device}, got {_describe(x)}"
        )
    return x


def _pages(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value bytes [nb, bs, 128] uint8, scales [nb, bs] f32) views of the page layout
    (bytes: indexing float8 tensors is not implemented everywhere)."""
    nb, bs, _ = cache.shape
    flat = cache.flatten(1)  # [nb, bs * 132], dim 0 may be strided (interleaved layers)
    values = flat[:, : bs * INDEX_HEAD_DIM].view(nb, bs, INDEX_HEAD_DIM)
    scales = flat[:, bs * INDEX_HEAD_DIM :].view(torch.float32)
    return values, scales


def insert_keys(
    cache: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, *, ue8m0: bool = True
) -> None:
    """Quantize ``k [T, 128]`` and write row ``t`` at physical slot ``slots[t]`` (< 0: skip;
    past the pool: IndexerError)."""
    _check_cache(cache)
    _check_index("slots", slots, 1, cache.device)
    t = slots.shape[0]
    if not isinstance(k, torch.Tensor) or k.shape != (t, INDEX_HEAD_DIM):
        raise IndexerError(f"k: expected [T={t}, {INDEX_HEAD_DIM}], got {_describe(k)}")
    if k.device != cache.device or not k.is_floating_point():
        raise IndexerError(f"k: expected a float tensor on {cache.device}, got {_describe(k)}")
    keep = slots >= 0
    if not bool(keep.any()):
        return
    slot = slots[keep].long()
    rows = cache.shape[0] * cache.shape[1]
    if int(slot.max()) >= rows:
        raise IndexerError(
            f"slots: expected < num_blocks * block_size = {rows} (or < 0: skip), "
            f"got {int(slot.max())}"
        )
    values, scales = quantize_rows(k[keep], ue8m0=ue8m0)
    page_values, page_scales = _pages(cache)
    bs = cache.shape[1]
    page, offset = slot // bs, slot % bs
    page_values[page, offset] = values.view(torch.uint8)
    page_scales[page, offset] = scales


def read_keys(cache: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [..., 128], float32 scales [...])`` of physical ``rows`` (all in range)."""
    _check_cache(cache)
    page_values, page_scales = _pages(cache)
    bs = cache.shape[1]
    rows = rows.long()
    values = page_values[rows // bs, rows % bs].view(torch.float8_e4m3fn)
    return values, page_scales[rows // bs, rows % bs]


def logits(
    q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """``[T, S]`` float32: ``k_scale[s] * sum_h weights[t, h] * relu(q[t, h] . k[s])``."""
    dots = torch.einsum("thd,sd->ths", q.float(), k.float()).relu_()
    return torch.einsum("th,ths->ts", weights.float(), dots) * k_scale.float()[None, :]


def select_topk(scores: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 ``[T, topk]``: per row the ``topk`` largest of ``scores[t, :lengths[t]]``,
    ties toward the lower position, descending; ``-1`` past ``min(topk, lengths[t])``."""
    t, s = scores.shape
    positions = torch.arange(s, device=scores.device)
    valid = positions[None, :] < lengths[:, None].long()
    masked = scores.float().masked_fill(~valid, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :topk]
    out = torch.full((t, topk), -1, dtype=torch.int32, device=scores.device)
    width = order.shape[1]
    take = torch.arange(width, device=scores.device)[None, :] < lengths[:, None].long()
    out[:, :width] = torch.where(take, order, -1).to(torch.int32)
    return out


def request_rows(block_table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Physical rows of request-local positions ``0 .. length - 1``."""
    positions = torch.arange(length, device=block_table_row.device)
    return block_table_row.long()[positions // block_size] * block_size + positions % block_size


def index_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """The indexer's selection for ``T`` tokens: int32 ``[T, topk]`` request-local positions.

    ``q [T, H, 128]`` (e4m3 or float), ``weights [T, H]``, ``block_tables [T, W]`` the
    block-table row of each token's request, ``lengths [T]`` its causal context length.
    """
    if q.dim() != 3 or q.shape[-1] != INDEX_HEAD_DIM:
        raise IndexerError(f"q: expected [T, H, {INDEX_HEAD_DIM}], got {tuple(q.shape)}")
    t = q.shape[0]
    for name, x, shape in (("weights", weights, (t, q.shape[1])), ("lengths", lengths, (t,))):
        if tuple(x.shape) != shape:
            raise IndexerError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    _check_cache(cache)
    _check_index("lengths", lengths, 1, q.device)
    _check_index("block_tables", block_tables, 2, q.device)
    if block_tables.shape[0] != t:
        raise IndexerError(f"block_tables: expected [T={t}, W], got {_describe(block_tables)}")
    if not isinstance(topk, int) or topk < 0:
        raise IndexerError(f"topk: expected an int >= 0, got {topk!r}")
    out = torch.full((t, topk), -1, dtype=torch.int32, device=q.device)
    nb, bs = cache.shape[:2]
    capacity = block_tables.shape[1] * bs
    q = q.float()  # exact for e4m3 inputs; float indexing works on every device
    for i in range(t):
        length = int(lengths[i])
        if length <= 0:
            continue
        if length > capacity:
            raise IndexerError(
                f"lengths: expected <= W * block_size = {capacity} (token {i}), got {length}"
            )
        pages = block_tables[i, : -(-length // bs)]
        if bool(((pages < 0) | (pages >= nb)).any()):
            raise IndexerError(
                f"block_tables: expected pages in [0, {nb}) for the {length} positions of "
                f"token {i}, got {pages.tolist()}"
            )
        k, k_scale = read_keys(cache, request_rows(block_tables[i], length, bs))
        scores = logits(q[i : i + 1], weights[i : i + 1], k, k_scale)
        out[i] = select_topk(scores, lengths[i : i + 1], topk)[0]
    return out
