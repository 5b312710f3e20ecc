"""vllm-mla: lean absorbed MLA weights and the tools that prove them.

The core (geometry, quant, weights, memory) never imports vLLM.
"""

__version__ = "0.1.0"


def register() -> dict[str, str]:
    """Apply the vLLM plugin now (idempotent): what vLLM's plugin loader does in every
    process. Call it before ``vllm.LLM(...)`` to name ``B12X_MLA_SPARSE`` in the Python
    API: ``LLM`` validates ``attention_config`` before it loads general plugins."""
    from vllm_mla.vllm import plugin

    return plugin.register()
