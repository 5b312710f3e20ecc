"""Patch vLLM's layerwise reload so a released kv_b_proj can take new weights.

Target: ``vllm.model_executor.model_loader.reload.layerwise
._copy_and_restore_kernel_tensors(layer, info)`` (vLLM 0.32, 0.33).
Why: reload copies freshly processed tensors into the parameters that existed
before (``param.data.copy_``) to keep CUDA-graph addresses; a kv_b_proj source the
lifecycle released is an empty placeholder, so that copy fails on shape (upstream's own
AMX release of kv_b_proj.weight hits the same copy).
How: for placeholders the lifecycle marked as released (and only those), the
parameter object is rebound to the fresh tensor first; the original then runs
unchanged, and the attention layer's post-load re-materializes the absorbed pair in
place and releases the source again.
Removal: when vLLM's reload rebinds size-changed kernel tensors itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vllm_mla.weights.sources import RELEASED_ATTR


def make_copy_and_restore(original: Callable) -> Callable:
    """The replacement for ``layerwise._copy_and_restore_kernel_tensors``."""

    def _copy_and_restore_kernel_tensors(layer: nn.Module, info: object) -> None:
        parameters, _ = info.kernel_tensors
        for name, param in parameters.items():
            fresh = getattr(layer, name, None)
            released = getattr(param, RELEASED_ATTR, False) and param.numel() == 0
            if released and isinstance(fresh, torch.Tensor) and fresh.numel() > 0:
                param.data = fresh.data
                delattr(param, RELEASED_ATTR)
        return original(layer, info)

    return _copy_and_restore_kernel_tensors
