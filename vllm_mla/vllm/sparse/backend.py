"""``B12X_MLA_SPARSE``: the attention backend class vLLM resolves by name.

Sparse MLA (DeepSeek-V3.2 / GLM-5 DSA), head size 576 (latent 512 + RoPE 64) or 512
(latent 512 without RoPE: GLM-5.3-Flash), MQA-only (every token goes
through ``forward_mqa`` with top-k selection; no dense MHA prefill), KV cache
``fp8_ds_mla`` (656-byte records), ``nvfp4_ds_mla`` (352) or bf16 (1152), kernel pages
of 64 rows, SM80 and newer.
Decode context parallelism: served (``supports_dcp`` reads the impl's; see its module).
Attention sink (HY-V4's learnable per-head logit): served (``supports_sink``), except
under decode context parallelism (``served``).
Never auto-selected: ``--attention-backend B12X_MLA_SPARSE`` (or ``CUSTOM``).

What it serves, and the refusal of anything else: ``served``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows

from vllm_mla.formats import (  # the kernels read 64-row pages
    PAGE_ROWS,
    SPARSE_BACKEND,
)
from vllm_mla.ops.sparse_mla.formats import ACCEPTED_CACHE_DTYPES
from vllm_mla.vllm.sparse.served import (
    SERVES,
    geometry_refusal,
    model_refusals,
    refusal,
)

if TYPE_CHECKING:
    from vllm.config.cache import CacheDType
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.kv_cache_interface import AttentionSpec

NAME = SPARSE_BACKEND
MIN_CAPABILITY = 8  # SM80: the portable Triton kernel's floor
# What a user may pass, from the KV-format table: each format's cache dtypes (auto and
# bfloat16 -> bf16 records, fp8_ds_mla, nvfp4_ds_mla) and the requests the
# sparse_kv_cache_dtype patch canonicalises (fp8, fp8_e4m3 -> fp8_ds_mla).
ACCEPTED_KV_CACHE_DTYPES = ACCEPTED_CACHE_DTYPES


class B12XMLASparseBackend(AttentionBackend):
    """Sparse-MLA backend over ``vllm_mla.ops.sparse_mla`` (b12x, Triton or torch)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(ACCEPTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type:
        from vllm_mla.vllm.sparse.impl import B12XMLASparseImpl

        return B12XMLASparseImpl

    @staticmethod
    def get_builder_cls() -> type:
        from vllm_mla.vllm.sparse.metadata import B12XMLASparseMetadataBuilder

        return B12XMLASparseMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(PAGE_ROWS)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SERVES.head_sizes)

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        # HY-V4 hands its fp32 [heads] sinks to the impl where this is True (and drops
        # them, warning only, where it is False)
        return SERVES.sink

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return SERVES.sliding_window

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        # Blocks start on whole 64-row pages, as upstream's sparse backends require.
        return align_blocks_to_rows(spec, PAGE_ROWS)

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major >= MIN_CAPABILITY

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        """Every unserved setting the selector shows, and the current model's, named in
        one reason (vLLM's generic reasons, e.g. "head_size not supported", stay too).
        With the backend forced, vLLM's selector raises at start-up with it."""
        from vllm.config import get_current_vllm_config_or_none

        reasons = []
        if not use_mla:
            reasons.append("use_mla=False (a non-MLA attention layer)")
        if not use_sparse:
            reasons.append("use_sparse=False (a dense MLA layer: no indexer top-k)")
        if use_mla:
            geometry = geometry_refusal(head_size)
            if geometry is not None:
                reasons.append(geometry)
        config = get_current_vllm_config_or_none()
        dcp_size = 1 if config is None else config.parallel_config.decode_context_parallel_size
        if has_sink and not SERVES.sink:
            reasons.append("has_sink=True (an attention sink)")
        elif has_sink and dcp_size > 1 and not SERVES.sink_under_dcp:
            reasons.append(
                f"has_sink=True with decode_context_parallel_size={dcp_size} (an attention "
                "sink under DCP)"
            )
        if kv_cache_dtype is not None and kv_cache_dtype not in ACCEPTED_KV_CACHE_DTYPES:
            reasons.append(f"kv_cache_dtype={kv_cache_dtype}")
        if config is not None:
            if config.attention_config.hisparse_config is not None:
                reasons.append("hisparse_config (a host-offloaded HiSparse KV cache)")
            if config.model_config is not None:
                reasons += model_refusals(config.model_config.hf_text_config, dcp_size)
        return refusal(list(dict.fromkeys(reasons)))
