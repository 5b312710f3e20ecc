"""The DSA lightning indexer (DeepSeek-V3.2 / GLM-5): index-key cache, logits, top-k.

``reference`` is the plain-torch oracle (numeric contract in its docstring); it serves
the indexer on CPU and is what any faster kernel is checked against. ``triton_kernels``
(imported on its own: it needs Triton) is the portable GPU indexer, SM80+: index-key
insert, paged logits over each token's block table, exact top-k for any K.
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
