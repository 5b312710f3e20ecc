"""Patch ``VllmConfig.try_verify_and_update_config``: carry B12X_MLA_SPARSE as CUSTOM.

Target: ``vllm.config.vllm.VllmConfig.try_verify_and_update_config(self)`` (vLLM 0.32,
0.33), feature ``sparse``.
Why: ``--attention-backend B12X_MLA_SPARSE`` puts a plugin-made ``AttentionBackendEnum``
member into the config. A process that unpickles the config before it loads general
plugins (vLLM's engine core on CPU, spawned workers, Ray) cannot resolve that member and
fails with "... is not a valid AttentionBackendEnum".
How: the original runs unchanged (it is called once, from ``VllmConfig.__post_init__``,
in the process that parsed the arguments); then, when the backend is the named member
and vLLM's ``CUSTOM`` slot is registered to the same class (the plugin does both), the
config carries ``CUSTOM`` instead: every process resolves it, and its plugin load maps
it to B12X_MLA_SPARSE. Logged once.
Removal: when vLLM loads general plugins before it builds or unpickles configs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vllm_mla.vllm.sparse.registration import NAME, selects_ours

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

        custom = AttentionBackendEnum.CUSTOM
        if selects_ours(custom):
            attention.backend = custom
            logger.info(
                "vllm-mla: %s is carried in the config as CUSTOM (registered to the same "
                "class) so processes that unpickle it before loading plugins resolve it",
                NAME,
            )

    return try_verify_and_update_config
