"""Patch ``CpuPlatform.get_attn_backend_cls`` so a sparse model can select B12X_MLA_SPARSE.

Target: ``vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls(cls, selected_backend,
attn_selector_config, num_heads)`` (a classmethod; vLLM 0.32, 0.33), feature
``sparse-cpu``, CPU platform only.
Why: it raises "Sparse Attention is not supported on CPU." for every sparse (DSA) model,
before the selected backend is looked at.
How: when the selector asks for sparse MLA and the selected backend is B12X_MLA_SPARSE
(by name, or CUSTOM registered to it), return its class path; everything else goes to
the original untouched (so the error stays for every other backend).
Removal: when the CPU platform lets a selected out-of-tree sparse backend through.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.vllm.sparse.registration import CLASS_PATH, selects_ours


def make_get_attn_backend_cls(original: Callable) -> Callable:
    """The replacement for ``CpuPlatform.get_attn_backend_cls`` (wrapped as a classmethod)."""

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if getattr(attn_selector_config, "use_sparse", False) and selects_ours(selected_backend):
            return CLASS_PATH
        return original(cls, selected_backend, attn_selector_config, num_heads)

    return get_attn_backend_cls
