"""Keep GLM-5.3-Flash's indexer ``wk_weights_proj`` weight on vLLM CPU.

Target: ``vllm.models.glm5next.common.attention.Indexer.__init__(self, vllm_config, config,
hidden_size, q_lora_rank, quant_config, cache_config, topk_indices_buffer, prefix)`` (vLLM
0.32, 0.33), feature ``sparse-cpu``, CPU platform only, applied when that module is first
imported (``Patch.on_import``).
Why: on CPU, ``UnquantizedLinearMethod.process_weights_after_loading`` packs a linear
layer's weight for oneDNN and replaces it with an empty placeholder; the indexer's first
forward then reads ``wk_weights_proj.weight.data[head_dim:, :]`` (the head weights it
keeps in fp32) and raises ``IndexError: too many indices for tensor of dimension 1``.
How: after the original constructor, ``wk_weights_proj._cpu_skip_gemm_dispatch = True``:
vLLM's own flag (it sets it on MLA's ``kv_b_proj``), so post-load keeps the weight and the
layer runs ``F.linear``. Only this layer; the projection is small (``head_dim + n_heads``
rows).
Removal: when vLLM CPU keeps the weights its model code reads after loading.
"""

from __future__ import annotations

from collections.abc import Callable


def make_init(original: Callable) -> Callable:
    """``Indexer.__init__``, then the fused key / head-weight projection keeps its weight."""

    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self.wk_weights_proj._cpu_skip_gemm_dispatch = True

    return __init__


__all__ = ["make_init"]
