"""Register ``B12X_MLA_SPARSE`` with vLLM's backend registry (idempotent).

vLLM raises when a name is registered twice, and the plugin may run several times
per process, so registration checks first. A spawned worker that unpickles the
config before plugins load cannot see a new enum member ("not a valid
AttentionBackendEnum"); the class is therefore also registered as ``CUSTOM``
(unless another plugin owns it), and ``--attention-backend CUSTOM`` is the fallback.
"""

from __future__ import annotations

from vllm_mla.vllm.sparse.backend import NAME

CLASS_PATH = "vllm_mla.vllm.sparse.backend.B12XMLASparseBackend"
FALLBACK_HINT = (
    f"select with --attention-backend {NAME} (carried as CUSTOM to processes that unpickle "
    "the config before loading plugins); in the Python API call vllm_mla.register() before "
    "LLM(...), or pass attention_config={'backend': 'CUSTOM'}"
)


def register() -> str:
    """Register the name (and CUSTOM when free); returns what happened, for the log."""
    from vllm.v1.attention.backends.registry import (
        _ATTN_OVERRIDES,
        AttentionBackendEnum,
        register_backend,
    )

    done = []
    if NAME not in AttentionBackendEnum.__members__:
        register_backend(NAME, CLASS_PATH)
        done.append(NAME)
    elif AttentionBackendEnum[NAME].get_path() != CLASS_PATH:
        raise RuntimeError(
            f"attention backend {NAME} is already registered to "
            f"{AttentionBackendEnum[NAME].get_path()}, expected {CLASS_PATH}"
        )
    custom = AttentionBackendEnum.CUSTOM
    owner = _ATTN_OVERRIDES.get(custom)
    if owner is None:
        register_backend(custom, CLASS_PATH)
        done.append("CUSTOM")
    elif owner != CLASS_PATH:
        return f"registered {NAME} (CUSTOM is taken by {owner}: no CUSTOM fallback)"
    what = " and ".join(done) if done else f"{NAME} and CUSTOM (already)"
    return f"registered {what}; {FALLBACK_HINT}"


def unregister_custom() -> None:
    """Drop our CUSTOM override (tests; the named member cannot be removed from the enum)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    if _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM) == CLASS_PATH:
        AttentionBackendEnum.CUSTOM.clear_override()


def selects_ours(backend: object) -> bool:
    """True when ``backend`` (an ``AttentionBackendEnum`` member, its name, or None) is
    B12X_MLA_SPARSE, directly or as the CUSTOM slot registered to it."""
    if backend is None:
        return False
    name = getattr(backend, "name", backend)
    if name == NAME:
        return True
    if name != "CUSTOM":
        return False
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    return _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM) == CLASS_PATH


def is_sparse_model(vllm_config: object) -> bool:
    """True for a DSA (DeepSeek-V3.2 / GLM-5) model: its hf config has ``index_topk``."""
    model_config = getattr(vllm_config, "model_config", None)
    hf = getattr(model_config, "hf_text_config", None) if model_config is not None else None
    return getattr(hf, "index_topk", None) is not None
