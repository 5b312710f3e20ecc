"""Every environment variable vllm-mla reads, in one place, typed.

``VLLM_MLA`` (bool, default on): ``0`` makes the vLLM plugin apply nothing.

``VLLM_MLA_FEATURES`` (comma list, default ``lifecycle,query``): the plugin features to
apply; known: ``lifecycle`` (lean absorbed weights in MLA post-load) and ``query`` (the
safe BMM in MLA's V up-projection where the GPU or backend needs it).

``TRITON_INTERPRET`` (bool, default off): Triton's own switch to run kernels in its
CPU interpreter; it also lets the fused query projection take CPU tensors (tests).

Build time only, read by setup.py (which cannot import the package):
``VLLM_MLA_CUDA_ARCHS`` (e.g. ``"90;120"``, default sm_80/86/89/90/100/120): the GPU
architectures the CUDA op is compiled for; ``none`` skips the CUDA op.
"""

from __future__ import annotations

import os

TRUE = ("1", "true", "yes", "on")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in TRUE


FEATURES = ("lifecycle", "query")


def plugin_enabled() -> bool:
    """False when ``VLLM_MLA`` is set to 0/false/no/off."""
    return os.environ.get("VLLM_MLA", "1").strip().lower() not in ("0", "false", "no", "off")


def plugin_features() -> tuple[frozenset[str], tuple[str, ...]]:
    """(features asked for by ``VLLM_MLA_FEATURES``, unknown names in it)."""
    raw = os.environ.get("VLLM_MLA_FEATURES")
    if raw is None:
        return frozenset(FEATURES), ()
    names = [n.strip() for n in raw.split(",") if n.strip()]
    return frozenset(n for n in names if n in FEATURES), tuple(
        n for n in names if n not in FEATURES
    )


def triton_interpret() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return _flag("TRITON_INTERPRET")
