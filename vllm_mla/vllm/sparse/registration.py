"""Register ``B12X_MLA_SPARSE`` with vLLM's backend registry (idempotent).

vLLM raises when a name is registered twice, and the plugin may run several times
per process, so registration checks first. vLLM's one shared ``CUSTOM`` slot is taken
only when it is needed: a process that unpickles the config before it loads plugins
(vLLM's engine core, spawned workers, Ray) cannot see a new enum member ("not a valid
AttentionBackendEnum"), so when the named backend is actually selected the config
carries ``CUSTOM`` (patch ``sparse_backend_portable``): ``claim_custom`` then registers
the slot (unless another plugin owns it) and exports ``VLLM_MLA_SPARSE_CUSTOM=1``, which
every process spawned afterwards inherits, so its plugin load registers the slot too.
``VLLM_MLA_SPARSE_CUSTOM=1`` set by the user claims it up front (to select the backend
as ``--attention-backend CUSTOM``).
"""

from __future__ import annotations

import os

from vllm_mla import envs
from vllm_mla.vllm.sparse.backend import NAME

CUSTOM_ENV = "VLLM_MLA_SPARSE_CUSTOM"

CLASS_PATH = "vllm_mla.vllm.sparse.backend.B12XMLASparseBackend"
FALLBACK_HINT = (
    f"select with --attention-backend {NAME} (carried as CUSTOM to processes that unpickle "
    "the config before loading plugins); in the Python API call vllm_mla.register() before "
    f"LLM(...), or set {CUSTOM_ENV}=1 and pass attention_config={{'backend': 'CUSTOM'}}"
)


def custom_wanted() -> bool:
    """True when ``VLLM_MLA_SPARSE_CUSTOM`` is on (set by the user, or by ``claim_custom``
    in the process that spawned this one)."""
    return envs.sparse_custom()


def claim_custom() -> str | None:
    """Register the CUSTOM slot to this backend (if free) and export the claim to the
    processes spawned from here on; the owner's class path when another plugin has it."""
    from vllm.v1.attention.backends.registry import (
        _ATTN_OVERRIDES,
        AttentionBackendEnum,
        register_backend,
    )

    custom = AttentionBackendEnum.CUSTOM
    owner = _ATTN_OVERRIDES.get(custom)
    if owner is None:
        register_backend(custom, CLASS_PATH)
    elif owner != CLASS_PATH:
        return owner
    os.environ[CUSTOM_ENV] = "1"
    return None


def register() -> str:
    """Register the name (CUSTOM too when claimed); returns what happened, for the log."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    done = []
    if NAME not in AttentionBackendEnum.__members__:
        register_backend(NAME, CLASS_PATH)
        done.append(NAME)
    elif AttentionBackendEnum[NAME].get_path() != CLASS_PATH:
        raise RuntimeError(
            f"attention backend {NAME} is already registered to "
            f"{AttentionBackendEnum[NAME].get_path()}, expected {CLASS_PATH}"
        )
    what = " and ".join(done) if done else f"{NAME} (already)"
    if not custom_wanted():
        return f"registered {what}; {FALLBACK_HINT}"
    owner = claim_custom()
    if owner is not None:
        return f"registered {what} (CUSTOM is taken by {owner}: no CUSTOM fallback)"
    return f"registered {what} and CUSTOM ({CUSTOM_ENV}=1); {FALLBACK_HINT}"


def unregister_custom() -> None:
    """Drop our CUSTOM override and its exported claim (tests; the named member cannot be
    removed from the enum)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    if _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM) == CLASS_PATH:
        AttentionBackendEnum.CUSTOM.clear_override()
    os.environ.pop(CUSTOM_ENV, None)


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
