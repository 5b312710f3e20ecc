"""Patch ``CpuPlatform.check_and_update_config``: 64-row KV pages for B12X_MLA_SPARSE.

Target: ``vllm.platforms.cpu.CpuPlatform.check_and_update_config(cls, vllm_config)`` (a
classmethod; vLLM 0.32, 0.33), feature ``sparse-cpu``, CPU platform only.
Why: for every MLA model it forces ``block_size=16`` (the CPU MLA decode kernel's) or,
on AMX hosts, defaults to 128; the sparse backend reads 64-row pages and vLLM's DSA
indexer cache accepts only 64.
How: the original runs unchanged; then, for a sparse (DSA) model with B12X_MLA_SPARSE
selected, a block size that is not a multiple of 64 becomes 64 (logged), and 128 or
larger becomes 64 too (the indexer cache cannot be split into 64-row kernel blocks).
Removal: when the CPU platform asks the selected backend for its block size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vllm_mla.formats import PAGE_ROWS  # the only page size vLLM's DSA indexer cache takes
from vllm_mla.vllm.sparse.registration import is_sparse_model, selects_ours

logger = logging.getLogger("vllm_mla")


def make_check_and_update_config(original: Callable) -> Callable:
    """The replacement for ``CpuPlatform.check_and_update_config`` (a classmethod)."""

    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        attention = getattr(vllm_config, "attention_config", None)
        if not (is_sparse_model(vllm_config) and selects_ours(getattr(attention, "backend", None))):
            return
        cache = vllm_config.cache_config
        if cache.block_size != PAGE_ROWS:
            logger.info(
                "vllm-mla: B12X_MLA_SPARSE on CPU: block_size %s -> %s (64-row pages)",
                cache.block_size,
                PAGE_ROWS,
            )
            cache.block_size = PAGE_ROWS

    return check_and_update_config
