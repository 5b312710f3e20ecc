"""Patch ``SpecDecodeBaseProposer._create_draft_vllm_config``: an MTP draft of a DSA model
served by B12X_MLA_SPARSE uses B12X_MLA_SPARSE too.

Target: ``vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer
._create_draft_vllm_config(self)`` (vLLM 0.32, 0.33), feature ``sparse``.
Why: the draft never inherits the target's attention backend ("we always independently
autoselect unless explicitly specified in the speculative config"), and auto-selection
knows no out-of-tree backend: on CPU it raises "Sparse Attention is not supported on CPU."
while building the draft's MLA layer, on GPUs without a sparse backend of vLLM's the
same; a user would have to repeat the backend in ``speculative_config``.
How: the original runs; when it left the draft's backend unset, the draft model is a DSA
model and the target selected B12X_MLA_SPARSE, the draft gets the target's selection. An
explicit ``speculative_config.attention_backend`` is kept as given.
Removal: when vLLM lets a draft inherit an out-of-tree backend of its target.

vLLM 0.34 does (the removal condition, met there): the draft's config is the target's with
``SpeculativeConfig.apply_draft_overrides`` (``config/speculative.py``), which overrides the
attention backend only when ``speculative_config.attention_backend`` is set, and
``llm_base_proposer`` is gone. The registry's ``upstream_at`` leaves the patch out there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from vllm_mla.vllm.sparse.registration import selects_ours


def _draft_is_sparse(proposer) -> bool:
    spec = getattr(proposer, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    hf = getattr(draft, "hf_text_config", None) or getattr(draft, "hf_config", None)
    return getattr(hf, "index_topk", None) is not None


def make_create_draft_vllm_config(original: Callable) -> Callable:
    """The replacement for ``SpecDecodeBaseProposer._create_draft_vllm_config``."""

    def _create_draft_vllm_config(self):
        config = original(self)
        target = self.vllm_config.attention_config.backend
        if (
            config.attention_config.backend is None
            and selects_ours(target)
            and _draft_is_sparse(self)
        ):
            attention = dataclasses.replace(config.attention_config, backend=target)
            config = dataclasses.replace(config, attention_config=attention)
        return config

    return _create_draft_vllm_config
