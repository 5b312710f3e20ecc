"""The DSA lightning indexer (DeepSeek-V3.2 / GLM-5): index-key cache, logits, top-k.

Modules: ``reference`` (the plain-torch oracle, numeric contract in its docstring; it
serves the indexer on CPU and is what any faster kernel is checked against), ``api`` (the
portable GPU indexer's public calls, SM80+: index-key insert, paged logits over each
token's block table, exact top-k for any K; imported on its own: it needs Triton),
``validate``, ``triton_kernels`` (kernels and launches), ``custom_op`` (the ops torch
sees), ``dispatch`` (reference or Triton per device) and ``dcp`` (top-k over a DCP
group).
"""

from vllm_mla.ops.sparse_indexer.reference import (
    INDEX_HEAD_DIM,
    RECORD_BYTES,
    IndexerError,
    index_topk,
    insert_keys,
    logits,
    quantize_rows,
    read_keys,
    request_rows,
    select_topk,
)

__all__ = [
    "INDEX_HEAD_DIM",
    "RECORD_BYTES",
    "IndexerError",
    "index_topk",
    "insert_keys",
    "logits",
    "quantize_rows",
    "read_keys",
    "request_rows",
    "select_topk",
]
