"""Patch GLM-5.3-Flash's KDA prefill state gather for CPU tensors.

Target: ``vllm.models.glm5next.common.kda.gather_initial_states(state, indices,
has_initial_state)`` (the name the KDA module imports from vLLM's mamba ops; vLLM 0.32,
0.33, 0.34), feature ``sparse-cpu``, CPU platform only, applied when that module is
imported.
Why: it asserts a CUDA or XPU state before its Triton kernel, so KDA prefill stops on CPU.
How: CPU tensors: ``vllm_mla.ops.kda.reference.gather_initial_states`` (the rows at the
indices, zeros where a request has no state yet; telemetry ``kda:gather:cpu``); everything
else to the original.
Removal: when vLLM CPU serves KDA layers.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.ops.kda import reference
from vllm_mla.vllm import telemetry
from vllm_mla.vllm.patches.cpu_glm5next_kda_chunk import on_cpu


def make_gather_initial_states(original: Callable) -> Callable:
    """The replacement for ``gather_initial_states``."""

    def gather_initial_states(state, indices, has_initial_state):
        if not on_cpu(state):
            return original(state, indices, has_initial_state)
        telemetry.record_sparse("kda:gather:cpu")
        return reference.gather_initial_states(state, indices, has_initial_state)

    return gather_initial_states
