"""Patch vLLM's unquantized MoE setup so a weight update on CPU prepacks the new experts.

Target: ``vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method
.UnquantizedFusedMoEMethod._setup_kernel(self, layer, w13, w2)`` (vLLM 0.32, 0.33, 0.34),
CPU platform only.
Why: on first load it runs the experts' ``process_weights_after_loading``, which on CPU
pads and prepacks ``w13_weight`` / ``w2_weight`` into the grouped-GEMM layout; on a weight
update (``reload_weights``: its kernel already exists) it skips that step, so the new
experts land unpacked in tensors the CPU kernel reads as packed, and every MoE layer
computes garbage after a reload.
How: after the original, on a weight update served by vLLM CPU's experts
(``fused_moe.experts.cpu_moe``), their ``process_weights_after_loading`` runs on the new
weights; the layerwise reload then copies the packed tensors into the old storage, as on
first load. Other experts go to the original untouched.
Removal: when vLLM re-runs the experts' post-load on weight updates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CPU_EXPERTS_MODULE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"


def make_setup_kernel(original: Callable) -> Callable:
    """The replacement for ``UnquantizedFusedMoEMethod._setup_kernel``."""

    def _setup_kernel(self, layer: torch.nn.Module, w13: torch.Tensor, w2: torch.Tensor):
        update = getattr(self, "moe_kernel", None) is not None
        result = original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and type(experts).__module__ == CPU_EXPERTS_MODULE:
            experts.process_weights_after_loading(layer)
        return result

    return _setup_kernel
