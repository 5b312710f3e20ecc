"""Every environment variable vllm-mla reads, in one place, typed.

``TRITON_INTERPRET`` (bool, default off): Triton's own switch to run kernels in its
CPU interpreter; it also lets the fused query projection take CPU tensors (tests).

Build time only, read by setup.py (which cannot import the package):
``VLLM_MLA_CUDA_ARCHS`` (e.g. ``"90;120"``, default sm_80/86/89/90/100/120): the GPU
architectures the CUDA op is compiled for.
"""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in TRUE


def triton_interpret() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return _flag("TRITON_INTERPRET")
