"""KDA, GLM-5.3-Flash's linear-attention layers: ``reference`` is the plain-torch
recurrence vLLM's Triton kernels compute (its contract in its docstring), which serves the
layers on hosts without Triton. GPUs run vLLM's own kernels."""

from vllm_mla.ops.kda.reference import (
    KDAError,
    chunk_with_fused_gate,
    fused_recurrent,
    gather_initial_states,
    safe_gate,
    scatter_states,
)

__all__ = [
    "KDAError",
    "chunk_with_fused_gate",
    "fused_recurrent",
    "gather_initial_states",
    "safe_gate",
    "scatter_states",
]
