"""KV-cache capacity per record format: bytes a token costs and tokens a budget holds.

Derived from the KV-format table (``ops.sparse_mla.formats.KV_FORMAT_TABLE``): a format
added there appears here. An MLA layer caches one latent record per token (no KV heads
to shard), so tensor parallelism replicates it on every rank; decode context parallelism
(DCP N) spreads a sequence's tokens over N ranks, so a rank holds 1/N of them. A DSA
model also caches one indexer key per token and layer (fp8: 128 e4m3 + one fp32 scale,
132 bytes), sharded the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mla.ops.sparse_mla.formats import KV_FORMAT_TABLE, record_bytes

GIB = 1 << 30
DSA_INDEX_BYTES = 132  # the indexer's fp8 key (128 e4m3) and its fp32 scale


@dataclass(frozen=True)
class CapacityRow:
    """One record format's cost and capacity for a model at a parallel layout."""

    kv_format: str
    summary: str
    record_bytes: int  # per token and layer
    tokens_per_gib_layer: int  # one layer's records in a GiB
    bytes_per_token_rank: float  # one token of context, all layers, on one rank
    context_tokens: int  # context the per-rank budget holds (all DCP ranks together)


def capacity(
    layers: int, budget_gib: float, dcp: int = 1, index_bytes: int = DSA_INDEX_BYTES
) -> list[CapacityRow]:
    """A row per KV format: ``layers`` cached layers, ``budget_gib`` of KV cache per rank,
    DCP ``dcp``, ``index_bytes`` of indexer key per token and layer (0: no indexer)."""
    if layers < 1 or dcp < 1 or budget_gib <= 0 or index_bytes < 0:
        raise ValueError(
            f"capacity: expected layers >= 1, dcp >= 1, budget_gib > 0, index_bytes >= 0; "
            f"got {layers}, {dcp}, {budget_gib}, {index_bytes}"
        )
    rows = []
    for fmt in KV_FORMAT_TABLE:
        record = record_bytes(fmt.name)
        per_rank = (record + index_bytes) * layers / dcp
        rows.append(
            CapacityRow(
                fmt.name,
                fmt.summary,
                record,
                GIB // record,
                per_rank,
                int(budget_gib * GIB // per_rank),
            )
        )
    return rows
