"""Patch vLLM 0.32's HY-V4 weight loading so ``reload_weights`` serves the new sink.

Target: ``vllm.models.hy_v4.nvidia.model.HYV4Model.load_weights(self, weights)`` (vLLM
0.32; 0.33 builds the sink with ``make_attention_sink``, whose weight loader reload wraps).
Why: it copies each layer's ``learnable_sink_param`` shard straight into the parameter
(``params_dict[name][:n].copy_``), past any ``weight_loader``. vLLM's layerwise reload
moves parameters to the meta device and counts only what their (wrapped) loaders load,
so on reload the copy lands nowhere, the layer counts nothing loaded ("HYV4MLAAttention:
Failed to load weights") and the old sink is put back: the engine serves the new
checkpoint's weights with the old checkpoint's sinks.
How: the sink entries are held back from the original (every other weight streams through
it unchanged); each is then narrowed to this rank's heads as the original does and loaded
through the parameter's ``weight_loader``, which is ``load_sink_heads`` (set on first
load). On first load that is the original's copy; on reload the layerwise wrapper counts
it and copies the new sink into the same storage (the pointer the attention impl holds).
Removal: with vLLM 0.32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

SINK = "learnable_sink_param"


def load_sink_heads(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """The original's copy: this rank's heads into the first rows of ``param``."""
    param.data[: loaded_weight.shape[0]].copy_(loaded_weight)


def make_load_weights(original: Callable) -> Callable:
    """The replacement for ``HYV4Model.load_weights``."""
    return sinks_through_their_loader(original, SINK)


def sinks_through_their_loader(original: Callable, marker: str) -> Callable:
    """``original`` (a model's ``load_weights``) with the weights whose names hold
    ``marker`` (its per-head sinks) held back, then each loaded through its parameter's
    ``weight_loader`` (``load_sink_heads`` where it has none), narrowed to this rank's
    heads."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        held: list[tuple[str, torch.Tensor]] = []

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, weight in weights:
                if marker in name:
                    held.append((name, weight))
                else:
                    yield name, weight

        loaded = original(self, others())
        params = dict(self.named_parameters())
        heads = self.config.num_attention_heads // get_tensor_model_parallel_world_size()
        start = heads * get_tensor_model_parallel_rank()
        for name, weight in held:
            param = params.get(name)
            if param is None:  # a layer another pipeline stage holds
                continue
            if not hasattr(param, "weight_loader"):
                param.weight_loader = load_sink_heads
            param.weight_loader(param, weight[start : start + heads])
            loaded.add(name)
        return loaded

    return load_weights
