"""Patch vLLM's layerwise reload so GLM-5.3-Flash's indexer scores with the new weights.

Target: ``vllm.model_executor.model_loader.reload.layerwise.finalize_layerwise_processing(
model, model_config)`` (vLLM 0.32, 0.33; 0.34 refills the copy in the indexer's own
``process_weights_after_loading``).
Why: GLM-5.3-Flash's kpool ``Indexer`` (``vllm.models.glm5next.common.attention``) keeps an
fp32 copy of its head-weight projection, ``_wp_fp32`` (``wk_weights_proj.weight[head_dim:]``
transposed), made at its first forward and never again: after ``reload_weights`` the
indexer keeps weighting its heads with the old checkpoint's projection, so it selects
other pools than the new model does (every output moves once top-k is below the context).
How: after the original finishes the reload, each such indexer holding the copy has it
refilled in place from the reloaded weight, with the expression vLLM builds it with (in
place: a captured CUDA graph keeps reading the same tensor). First loads hold no copy yet.
Removal: with vLLM 0.33.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INDEXER_MODULE = "vllm.models.glm5next.common.attention"
COPY = "_wp_fp32"


def head_weights_fp32(indexer: torch.nn.Module) -> torch.Tensor:
    """vLLM's ``_wp_fp32``: ``wk_weights_proj.weight[head_dim:, :]`` transposed, fp32."""
    weight = indexer.wk_weights_proj.weight.data
    return weight[indexer.head_dim :, :].t().contiguous().float()


def refill(model: torch.nn.Module) -> int:
    """Refill every GLM-5.3-Flash indexer's held ``_wp_fp32`` in place; how many."""
    count = 0
    for module in model.modules():
        held = getattr(module, COPY, None)
        if type(module).__module__ == INDEXER_MODULE and isinstance(held, torch.Tensor):
            with torch.inference_mode():  # the copy was made in a forward: an inference tensor
                held.copy_(head_weights_fp32(module))
            count += 1
    return count


def make_finalize(original: Callable) -> Callable:
    """The replacement for ``layerwise.finalize_layerwise_processing``."""

    def finalize_layerwise_processing(model: torch.nn.Module, model_config: object):
        result = original(model, model_config)
        refill(model)
        return result

    return finalize_layerwise_processing
