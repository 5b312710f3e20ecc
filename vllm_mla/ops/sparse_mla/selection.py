"""The top-k selection source of a sparse-MLA layer: the indexer, or an explicit buffer.

The model's indexer owns the top-k buffer (``indexer.topk_indices_buffer``, logical
in-request positions, -1 = empty) and speculative decoding re-points draft layers'
indexers at the target's buffer after the attention impls exist. So:

- with an indexer, only the indexer reference is kept and the buffer is resolved on
  every read; a buffer passed alongside it is dropped, never kept as a fallback (a
  kept fallback pinned 25 MB of draft storage per rank);
- without an indexer (backbone skip-top-k layers), the explicit buffer is kept;
- an explicit assignment supersedes the indexer (upstream's setter semantics).
"""

from __future__ import annotations

import weakref

import torch

from vllm_mla.ops.dcp import NO_DCP, DCPShard


class SelectionUnavailable(RuntimeError):
    """Neither an indexer buffer nor an explicit buffer is available."""


class TopkSelection:
    """Resolves the top-k index buffer per call; holds no shadow of the indexer's buffer."""

    __slots__ = ("_buffer", "_checked", "_indexer")

    def __init__(self, indexer: object | None = None, buffer: torch.Tensor | None = None) -> None:
        self._indexer = indexer
        # A weak reference to the last buffer that passed resolve()'s checks (weak: it
        # must not pin a buffer the indexer stops using).
        self._checked: weakref.ref | None = None
        # With an indexer the buffer is the indexer's; keeping it here would pin storage
        # the indexer may later stop using (MTP re-points draft indexers).
        self._buffer = buffer if indexer is None else None

    @property
    def indexer(self) -> object | None:
        return self._indexer

    @property
    def owned_by_indexer(self) -> bool:
        return self._indexer is not None

    def buffer(self) -> torch.Tensor | None:
        """The current buffer (the indexer's, read now), or None."""
        if self._indexer is not None:
            return getattr(self._indexer, "topk_indices_buffer", None)
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor | None) -> None:
        """Use ``buffer`` from now on, superseding the indexer."""
        self._indexer = None
        self._buffer = buffer

    def resolve(self, num_tokens: int) -> torch.Tensor:
        """``buffer[:num_tokens]`` as int32 ``[T, K]``; typed error when unavailable."""
        buffer = self.buffer()
        checked = self._checked
        if checked is not None and checked() is buffer and num_tokens <= buffer.shape[0]:
            return buffer[:num_tokens]  # the buffer checked last time (the indexer keeps one)
        if buffer is None:
            source = "indexer.topk_indices_buffer" if self._indexer is not None else "buffer"
            raise SelectionUnavailable(f"no top-k indices: {source} is None")
        if buffer.dtype != torch.int32 or buffer.dim() != 2:
            raise TypeError(
                f"top-k buffer: expected int32 [tokens, topk], got {buffer.dtype} "
                f"{list(buffer.shape)}"
            )
        if num_tokens > buffer.shape[0]:
            raise ValueError(
                f"top-k buffer: expected at least {num_tokens} rows, got {buffer.shape[0]}"
            )
        self._checked = weakref.ref(buffer)
        return buffer[:num_tokens]


def logical_to_physical(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    topk: torch.Tensor,
    block_size: int,
    out: torch.Tensor | None = None,
    shard: DCPShard = NO_DCP,
) -> torch.Tensor:
    """Torch reference of vLLM's ``triton_convert_req_index_to_global_index`` (and, with
    a DCP ``shard``, of its ``triton_filter_and_convert_dcp_index`` with
    ``compact_valid_to_front=False``).

    ``out[t, k] = block_table[req_id[t], topk[t, k] // block_size] * block_size
    + topk[t, k] % block_size``; -1 where ``topk`` is negative or its block is past the
    table. Physical row ``r`` is ``cache[r // block_size, r % block_size]``. With ``out``
    (int32, ``topk``'s shape) the rows are written there and ``out`` is returned. Under
    DCP ``topk`` holds request positions: those another rank holds become -1, the rest
    this rank's local positions (``DCPShard.to_local``), which its block table maps.
    """
    if topk.dtype != torch.int32 or block_table.dtype != torch.int32:
        raise TypeError(f"topk, block_table: expected int32, got {topk.dtype}, {block_table.dtype}")
    if req_id.shape[0] != topk.shape[0]:
        raise ValueError(f"req_id: expected {topk.shape[0]} rows, got {req_id.shape[0]}")
    logical = shard.to_local(topk.long())
    block = logical.div(block_size, rounding_mode="floor")
    valid = (logical >= 0) & (block < block_table.shape[1])
    rows = req_id.long()[:, None].expand_as(block)
    base = block_table.long()[rows, block.clamp(0, block_table.shape[1] - 1)]
    physical = base * block_size + logical.remainder(block_size)
    rows = torch.where(valid, physical, -1).to(torch.int32)
    if out is None:
        return rows
    return out.copy_(rows)
