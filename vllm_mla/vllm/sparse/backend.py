"""``B12X_MLA_SPARSE``: the attention backend class vLLM resolves by name.

Sparse MLA (DeepSeek-V3.2 / GLM-5 DSA), head size 576, MQA-only (every token goes
through ``forward_mqa`` with top-k selection; no dense MHA prefill), KV cache
``fp8_ds_mla`` (656-byte records) or bf16, kernel pages of 64 rows, SM80 and newer.
Decode context parallelism: served (``supports_dcp`` reads the impl's; see its module).
Never auto-selected: ``--attention-backend B12X_MLA_SPARSE`` (or ``CUSTOM``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows

from vllm_mla.formats import HEAD_DIM, PAGE_ROWS, SPARSE_BACKEND  # the kernels read 64-row pages

if TYPE_CHECKING:
    from vllm.config.cache import CacheDType
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.kv_cache_interface import AttentionSpec

NAME = SPARSE_BACKEND
MIN_CAPABILITY = 8  # SM80: the portable Triton kernel's floor
# What a user may pass (canonicalised by the sparse_kv_cache_dtype patch: fp8 and auto
# -> fp8_ds_mla, bfloat16 kept).
ACCEPTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")


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
        return [HEAD_DIM]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

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
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is None:
            return None
        if config.attention_config.hisparse_config is not None:
            return f"{NAME} does not serve HiSparse (host-offloaded) KV caches"
        if config.model_config is not None:
            hf = config.model_config.hf_text_config
            if getattr(hf, "index_topk", None) is None:
                return f"{NAME} needs a sparse (DSA) model: hf config has no index_topk"
            if getattr(hf, "kv_lora_rank", 512) != 512 or getattr(hf, "qk_rope_head_dim", 64) != 64:
                return (
                    f"{NAME} needs kv_lora_rank=512 and qk_rope_head_dim=64, got "
                    f"{getattr(hf, 'kv_lora_rank', None)} and "
                    f"{getattr(hf, 'qk_rope_head_dim', None)}"
                )
        return None
