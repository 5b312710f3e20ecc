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
    f"select with --attention-backend {NAME}; where a spawned worker cannot see the "
    "new name (spawn, Ray, NUMA binding) use --attention-backend CUSTOM"
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
