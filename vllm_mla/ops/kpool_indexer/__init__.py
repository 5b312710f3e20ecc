"""The kpool DSA indexer of GLM-5.3-Flash (``Glm5NextForCausalLM``): pool compression of
the index keys, pool logits, top-k over pools expanded to tokens plus the tail.

Modules: ``reference`` (the plain-torch oracle, numeric contract in its docstring; it
serves the indexer on CPU), ``api`` (the public calls with their argument checks),
``triton_kernels`` (pool compression, SM80+), ``dispatch`` (reference or Triton per
device) and ``custom_op`` (the ops torch sees). The pool cache, its logits and top-k are
the V3.2 indexer's (``vllm_mla.ops.sparse_indexer``) over pool-granular rows.
"""

from vllm_mla.ops.kpool_indexer.reference import (
    IndexerError,
    compress_pools,
    compressed_slot_mapping,
    decode_step,
    dense_topk,
    expand_pools_and_tail,
    fold_weights,
    hadamard128,
    index_topk,
    output_width,
    quantize_query,
    request_pools,
)

__all__ = [
    "IndexerError",
    "compress_pools",
    "compressed_slot_mapping",
    "decode_step",
    "dense_topk",
    "expand_pools_and_tail",
    "fold_weights",
    "hadamard128",
    "index_topk",
    "output_width",
    "quantize_query",
    "request_pools",
]
