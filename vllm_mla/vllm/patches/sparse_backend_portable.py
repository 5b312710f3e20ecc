"""Patch ``VllmConfig.try_verify_and_update_config``: carry B12X_MLA_SPARSE as CUSTOM.

Target: ``vllm.config.vllm.VllmConfig.try_verify_and_update_config(self)`` (vLLM 0.32,
0.33), feature ``sparse``.
Why: ``--attention-backend B12X_MLA_SPARSE`` puts a plugin-made ``AttentionBackendEnum``
member into the config. A process that unpickles the config before it loads general
plugins (vLLM's engine core on CPU, spawned workers, Ray) cannot resolve that member and
fails with "... is not a valid AttentionBackendEnum".
How: the original runs unchanged (it is called once, from ``VllmConfig.__post_init__``,
in the process that parsed the arguments); then, when the backend is the named member,
vLLM's ``CUSTOM`` slot is claimed for the same class (``registration.claim_custom``: only
now, when this backend is really selected; it also exports ``VLLM_MLA_SPARSE_CUSTOM=1``
so processes spawned later claim it at their plugin load) and the config carries
``CUSTOM`` instead: every process resolves it. When another plugin owns CUSTOM the name
stays (and a warning says processes that unpickle early may fail). Logged once.
Removal: when vLLM loads general plugins before it builds or unpickles configs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vllm_mla.vllm.sparse.registration import NAME, claim_custom

logger = logging.getLogger("vllm_mla")


def make_try_verify_and_update_config(original: Callable) -> Callable:
    """The replacement for ``VllmConfig.try_verify_and_update_config``."""

    def try_verify_and_update_config(self) -> None:
        original(self)
        attention = getattr(self, "attention_config", None)
        backend = getattr(attention, "backend", None)
        if getattr(backend, "name", None) != NAME:
            return
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        owner = claim_custom()
        if owner is not None:
            logger.warning(
                "vllm-mla: %s stays named in the config (CUSTOM belongs to %s); a process "
                "that unpickles the config before loading plugins cannot resolve it",
                NAME,
                owner,
            )
            return
        attention.backend = AttentionBackendEnum.CUSTOM
        logger.info(
            "vllm-mla: %s is carried in the config as CUSTOM (registered to the same "
            "class) so processes that unpickle it before loading plugins resolve it",
            NAME,
        )

    return try_verify_and_update_config
