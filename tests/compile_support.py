"""Which torch versions compile through vllm-mla's tensor subclass (``AbsorbedWeight``)."""

from __future__ import annotations

import pytest
import torch

TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

# Before 2.13 Dynamo runs a tensor subclass's op on fake tensors (it reads their data
# pointers) instead of tracing its custom op; vLLM, whose compiled region this is, pins
# torch >= 2.13. The preflight under torch 2.11 (the GPU image's) runs these tests too.
needs_subclass_compile = pytest.mark.skipif(
    TORCH < (2, 13),
    reason=f"torch {torch.__version__}: Dynamo runs a tensor subclass's op on fake tensors "
    "before 2.13 (vLLM, whose compiled region this is, pins torch >= 2.13)",
)
