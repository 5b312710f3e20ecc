"""Patch vLLM's layerwise reload so GLM-5.3-Flash serves the new weights everywhere.

Target: ``vllm.model_executor.model_loader.reload.layerwise.finalize_layerwise_processing(
model, model_config)`` (vLLM 0.32, 0.33; 0.34 refills the indexer's copy in its own
``process_weights_after_loading`` and holds the KDA convolutions as one fused parameter).
Why: two GLM-5.3-Flash layers keep a copy of loaded weights made at their first forward
and never again, so after ``reload_weights`` they serve the old checkpoint's values:

- the kpool ``Indexer`` (``vllm.models.glm5next.common.attention``): ``_wp_fp32``, its
  head-weight projection in fp32 (``wk_weights_proj.weight[head_dim:]`` transposed); it
  then selects other pools than the new model does (every output moves once top-k is
  below the context: a 3.4-nat miss);
- the KDA layer (``vllm.models.glm5next.common.kda``): ``_merged_conv_weight``, its q, k
  and v short-convolution weights concatenated; every KDA layer then convolves with the
  old weights (the reloaded tiny KDA model matched neither checkpoint: median 7.1 nats).

How: after the original finishes the reload, each such copy is refilled in place from the
reloaded weights with the expression vLLM builds it with (in place: a captured CUDA graph
keeps reading the same tensor). First loads hold no copy yet.
Removal: with vLLM 0.33.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INDEXER_MODULE = "vllm.models.glm5next.common.attention"
KDA_MODULE = "vllm.models.glm5next.common.kda"


def head_weights_fp32(indexer: torch.nn.Module) -> torch.Tensor:
    """vLLM's ``_wp_fp32``: ``wk_weights_proj.weight[head_dim:, :]`` transposed, fp32."""
    weight = indexer.wk_weights_proj.weight.data
    return weight[indexer.head_dim :, :].t().contiguous().float()


def merged_conv_weight(kda: torch.nn.Module) -> torch.Tensor:
    """vLLM's ``_merged_conv_weight``: the q, k, v conv weights ``[C, 1, W]`` as one
    ``[3C, W]``."""
    convs = (kda.q_conv1d, kda.k_conv1d, kda.v_conv1d)
    return torch.cat([c.weight.view(c.weight.size(0), c.weight.size(2)) for c in convs])


# module of the layer class -> (the copy it holds, how vLLM builds it)
COPIES: dict[str, tuple[str, Callable[[torch.nn.Module], torch.Tensor]]] = {
    INDEXER_MODULE: ("_wp_fp32", head_weights_fp32),
    KDA_MODULE: ("_merged_conv_weight", merged_conv_weight),
}


def refill(model: torch.nn.Module) -> int:
    """Refill every GLM-5.3-Flash layer's held copy (``COPIES``) in place; how many."""
    count = 0
    for module in model.modules():
        copy = COPIES.get(type(module).__module__)
        held = getattr(module, copy[0], None) if copy else None
        if isinstance(held, torch.Tensor):
            with torch.inference_mode():  # the copy was made in a forward: an inference tensor
                held.copy_(copy[1](module))
            count += 1
    return count


def make_finalize(original: Callable) -> Callable:
    """The replacement for ``layerwise.finalize_layerwise_processing``."""

    def finalize_layerwise_processing(model: torch.nn.Module, model_config: object):
        result = original(model, model_config)
        refill(model)
        return result

    return finalize_layerwise_processing
