"""Patch GLM-5.3-Flash's KDA prefill state scatter for CPU tensors.

Target: ``vllm.models.glm5next.common.kda.scatter_states(state, src, indices)`` (the name
the KDA module imports from vLLM's mamba ops; vLLM 0.32, 0.33, 0.34), feature
``sparse-cpu``, CPU platform only, applied when that module is imported.
Why: it asserts a CUDA state before its Triton kernel, so KDA prefill cannot store its
final states on CPU.
How: CPU tensors: ``state[indices] = src`` in the cache's dtype (telemetry
``kda:scatter:cpu``); everything else to the original. The original's
``register_warmup`` is kept (the layer's constructor calls it).
Removal: when vLLM CPU serves KDA layers.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.ops.kda import reference
from vllm_mla.vllm import telemetry
from vllm_mla.vllm.patches.cpu_glm5next_kda_chunk import on_cpu


def make_scatter_states(original: Callable) -> Callable:
    """The replacement for ``scatter_states``."""

    def scatter_states(state, src, indices):
        if not on_cpu(state):
            return original(state, src, indices)
        telemetry.record_sparse("kda:scatter:cpu")
        reference.scatter_states(state, src, indices)

    scatter_states.register_warmup = original.register_warmup  # called by the layer's init
    return scatter_states
