"""vllm-mla: lean absorbed MLA weights and the tools that prove them.

The core (geometry, quant, weights, memory) never imports vLLM.
"""

__version__ = "0.1.0"
