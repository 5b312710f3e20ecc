"""Registry of vLLM monkeypatches; applied by ``apply()``, never on import.

Each patch is one module here and one ``Patch`` entry below (a test checks that
the two agree and that every target exists in the installed vLLM):

``mla_post_load`` (feature ``lifecycle``)
    versions: 0.32, 0.33, 0.34; on 0.34 the target's parameters are (self)
    target: ``vllm.model_executor.layers.attention.mla_attention``
    ``.MLAAttention.process_weights_after_loading``
    why: upstream keeps a quantized kv_b_proj and a BF16 copy of it, built after
    dequant scratch has churned the allocator (holes)
    removal: when upstream MLA post-load preallocates the pair, bounds dequant scratch
    and releases kv_b_proj by backend capability

``reload_released`` (feature ``lifecycle``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.model_executor.model_loader.reload.layerwise``
    ``._copy_and_restore_kernel_tensors``
    why: reload copies new weights into the old parameters; a released kv_b_proj
    is an empty placeholder, so the copy fails on shape
    removal: when vLLM's reload rebinds size-changed kernel tensors itself

``hyv4_sink_reload`` (feature ``lifecycle``, applied when its module is imported)
    versions: 0.32, 0.33, 0.34; not applied on 0.33: its sink has a weight loader
    (make_attention_sink); not applied on 0.34: its sink has a weight loader
    (make_attention_sink)
    target: ``vllm.models.hy_v4.nvidia.model.HYV4Model.load_weights``
    why: it copies the learnable sink past any weight_loader, so a layerwise reload counts
    nothing loaded and puts the old sink back
    removal: with vLLM 0.32

``dsv4_sink_reload`` (feature ``lifecycle``, CPU platform, applied when its module is
imported)
    versions: 0.32, 0.33, 0.34; not applied on 0.33: its sink has a weight loader
    (make_attention_sink); not applied on 0.34: its sink has a weight loader
    (make_attention_sink)
    target: ``vllm.models.deepseek_v4.cpu.model.DeepseekV4Model.load_weights``
    why: it copies the attention sink past any weight_loader, so a layerwise reload counts
    nothing loaded and puts the old sink back
    removal: with vLLM 0.32

``cpu_moe_reload_prepack`` (feature ``lifecycle-cpu``, CPU platform)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method``
    ``.UnquantizedFusedMoEMethod._setup_kernel``
    why: a weight update skips the experts' post-load, which on CPU prepacks w13/w2, so
    reloaded experts are read unpacked
    removal: when vLLM re-runs the experts' post-load on weight updates

``glm5next_reload`` (feature ``lifecycle``)
    versions: 0.32, 0.33, 0.34; not applied on 0.34: the indexer refills _wp_fp32 in its
    process_weights_after_loading and the KDA convolutions are one fused parameter
    target: ``vllm.model_executor.model_loader.reload.layerwise``
    ``.finalize_layerwise_processing``
    why: GLM-5.3-Flash's indexer (fp32 head weights) and KDA layers (merged convolution
    weights) keep copies made at their first forward, so after a reload they serve the
    old weights
    removal: with vLLM 0.33

``mla_v_up_proj`` (feature ``query``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.model_executor.layers.attention.mla_attention``
    ``.MLAAttention._v_up_proj``
    why: cuBLAS batched BF16 GEMM over-reads the strided operand on SM120/121 (Xid 31)
    removal: when cuBLAS or upstream's _v_up_proj is safe on SM12x

``sparse_kv_cache_dtype`` (feature ``sparse``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.model_executor.layers.attention.mla_attention``
    ``._canonicalize_sparse_mla_kv_cache_dtype``
    why: upstream maps auto/fp8 to fp8_ds_mla only for its own sparse backends, by name
    removal: when upstream canonicalises by a backend attribute instead of by name

``dsv32_bf16_cache`` (feature ``sparse``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.model_executor.models.config.DeepseekV32ForCausalLM``
    ``.verify_and_update_config``
    why: it turns an explicit ``bfloat16`` KV cache into ``auto`` for DSA checkpoints
    removal: when upstream keeps an explicit bfloat16 cache dtype

``sparse_backend_portable`` (feature ``sparse``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.config.vllm.VllmConfig.try_verify_and_update_config``
    why: a process that unpickles the config before loading plugins cannot resolve the
    plugin-made B12X_MLA_SPARSE enum member
    removal: when vLLM loads general plugins before it builds or unpickles configs

``mtp_draft_backend`` (feature ``sparse``)
    versions: 0.32, 0.33; not applied on 0.34: vLLM 0.34 builds the draft from the
    target's config (SpeculativeConfig.apply_draft_overrides overrides the attention
    backend only when speculative_config.attention_backend is set), so an MTP draft
    keeps ``B12X_MLA_SPARSE``
    target: ``vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer``
    ``._create_draft_vllm_config``
    why: an MTP draft never inherits its target's attention backend, and auto-selection
    knows no out-of-tree one (on CPU: "Sparse Attention is not supported on CPU.")
    removal: when vLLM lets a draft inherit an out-of-tree backend of its target

``cpu_sparse_backend`` (feature ``sparse-cpu``, CPU platform)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls``
    why: it refuses every sparse model ("Sparse Attention is not supported on CPU.")
    removal: when the CPU platform lets a selected out-of-tree sparse backend through

``cpu_sparse_block_size`` (feature ``sparse-cpu``, CPU platform)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.platforms.cpu.CpuPlatform.check_and_update_config``
    why: it forces block_size 16 (or 128 on AMX) for MLA; the backend and vLLM's DSA
    indexer cache read 64-row pages
    removal: when the CPU platform asks the selected backend for its block size

``cpu_indexer_query_quant`` (feature ``sparse-cpu``, CPU platform)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.model_executor.models.deepseek_v2.per_token_group_quant_fp8``
    why: off CUDA/XPU it needs Triton, which vLLM CPU runs without
    removal: when vLLM ships a CPU per_token_group_fp8_quant

``cpu_indexer_query_quant_hy_v4`` (feature ``sparse-cpu``, CPU platform)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.hy_v4.nvidia.attention.per_token_group_quant_fp8``
    why: HY-V4's indexer calls the name it imported itself, the same Triton fallback
    removal: when vLLM ships a CPU per_token_group_fp8_quant

``cpu_glm5next_indexer_weights`` (feature ``sparse-cpu``, CPU platform, applied when its
module is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.glm5next.common.attention.Indexer.__init__``
    why: vLLM CPU's linear post-load leaves an empty placeholder weight, and GLM-5.3-Flash's
    indexer reads ``wk_weights_proj.weight`` in its first forward
    removal: when vLLM CPU keeps the weights its model code reads after loading

``cpu_glm5next_kda_chunk`` (feature ``sparse-cpu``, CPU platform, applied when its module
is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.glm5next.common.kda.chunk_kda_with_fused_gate``
    why: GLM-5.3-Flash's KDA prefill is Triton, which vLLM CPU runs without
    removal: when vLLM CPU serves KDA layers

``cpu_glm5next_kda_recurrent`` (feature ``sparse-cpu``, CPU platform, applied when its
module is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.glm5next.common.kda.fused_recurrent_kda``
    why: GLM-5.3-Flash's KDA decode and speculative verification are Triton
    removal: when vLLM CPU serves KDA layers

``cpu_glm5next_kda_gather`` (feature ``sparse-cpu``, CPU platform, applied when its module
is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.glm5next.common.kda.gather_initial_states``
    why: it asserts a CUDA or XPU state before its Triton kernel
    removal: when vLLM CPU serves KDA layers

``cpu_glm5next_kda_scatter`` (feature ``sparse-cpu``, CPU platform, applied when its module
is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.glm5next.common.kda.scatter_states``
    why: it asserts a CUDA state before its Triton kernel
    removal: when vLLM CPU serves KDA layers

``cpu_glm5next_mhc_pre`` (feature ``sparse-cpu``, CPU platform, applied when its module
is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.glm5next.common.model.Glm5NextDecoderLayer.hc_pre``
    why: vLLM CPU's mHC pre op drops the layer's input RMSNorm (and is in _C only)
    removal: when vLLM's CPU mHC ops apply ``norm_weight``

``cpu_glm5next_mhc_fused_post_pre`` (feature ``sparse-cpu``, CPU platform, applied when its
module is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.glm5next.common.model.Glm5NextDecoderLayer.hc_fused_post_pre``
    why: vLLM CPU's fused mHC post + pre op drops the RMSNorm it is passed
    removal: when vLLM's CPU mHC ops apply ``norm_weight``

``cpu_glm5next_mhc_post`` (feature ``sparse-cpu``, CPU platform, applied when its module
is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.glm5next.common.model.Glm5NextDecoderLayer.hc_post``
    why: vLLM CPU's mHC post op is in _C only (not _C_AVX2 / _C_AVX512)
    removal: when vLLM CPU's mHC post op runs on every host it loads

``cpu_dsv4_kernels`` (feature ``sparse-cpu``, CPU platform, applied when its module is
imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.deepseek_v4.cpu.model.DeepseekV4ForCausalLM.__init__``
    why: vLLM CPU's V4 kernels are in _C only; elsewhere V4 stops at its first kernel call
    removal: when vLLM CPU's V4 kernels are built into every library it loads

``cpu_dsv4_swa_indices`` (feature ``sparse-cpu``, CPU platform, applied when its module
is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.v1.attention.backends.mla.sparse_swa``
    ``.ComputeSWAIndicesAndLensKernel.__call__``
    why: DeepSeek-V4's sliding-window indices are a Triton kernel, which vLLM CPU cannot run
    removal: when vLLM CPU serves ComputeSWAIndicesAndLensKernel without Triton

``cpu_dsv4_tile_scheduler`` (feature ``sparse-cpu``, CPU platform, applied when its module
is imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.deepseek_v4.cpu.cpu_mla``
    ``.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler``
    why: it leaves out the c1a / c2a schedulers the shared builder reads (KeyError: 'c1a')
    removal: when vLLM's CPU builder returns every layer type the shared builder reads

``dsv4_gpu_capability`` (feature ``dsv4-gpu``, CUDA platform, applied when its module is
imported)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls``
    why: it picks FlashMLA's class on every GPU but SM12x without asking the backends'
    declared capabilities, so V4 on SM80 / SM89 fails inside a kernel at the first step
    removal: when vLLM's V4 selector checks its backends' declared capabilities

``wake_check_sleep`` (feature ``wake-check``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.v1.worker.gpu_worker.Worker.sleep``
    why: vLLM keeps no flag for weights discarded by sleep level 2 and not reloaded
    removal: when vLLM refuses to serve weights discarded and not reloaded

``wake_check_wake_up`` (feature ``wake-check``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.v1.worker.gpu_worker.Worker.wake_up``
    why: waking the weights after a level-2 sleep makes the check due
    removal: with ``wake_check_sleep``

``wake_check_execute_model`` (feature ``wake-check``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.v1.worker.gpu_worker.Worker.execute_model``
    why: the first step after the wake-up is the last moment before garbage is served
    removal: with ``wake_check_sleep``

``nvfp4_dcp_validator`` (feature ``sparse``)
    versions: 0.32, 0.33, 0.34; not applied on 0.32: its validator has no DCP refusal; not
    applied on 0.33: its validator has no DCP refusal
    target: ``vllm.config.vllm.VllmConfig.validate_nvfp4_kv_cache_with_mla``
    why: it refuses nvfp4_ds_mla with DCP > 1 for every backend, for a chunked-context
    prefill gather only FLASHMLA_SPARSE has
    removal: when upstream scopes the refusal to the backends with that prefill gather

``dsv32_nvfp4_write`` (feature ``sparse``, applied when its module is imported)
    versions: 0.32, 0.33, 0.34; on 0.32 the target's parameters are (positions, q_c,
    q_rms_norm_w, q_rms_eps, kv_c, kv_rms_norm_w, kv_rms_eps, k_pe, k_rope_cos_sin_cache,
    index_k, index_k_layer_norm_w, index_k_layer_norm_bias, index_k_layer_norm_eps,
    index_k_rope_cos_sin_cache, topk_indices_buffer, slot_mapping, indexer_slot_mapping,
    indexer_k_cache, indexer_cache_shuffled, mla_kv_cache, mla_kv_cache_dtype, mla_k_scale,
    has_indexer, index_rope_interleave, q_c_out, kv_c_out, k_pe_out, index_k_out)
    target: ``vllm.models.deepseek_v32.attention.fused_norm_rope``
    why: with the MLA cache passed it writes nvfp4_ds_mla records with
    ``cvt.rn.satfinite.e2m1x2`` (SM100a/SM120a PTX), so SM80/89/90 fail at the first forward
    removal: when upstream's nvfp4 writer runs without FP4 PTX

``tp_pad_config`` (feature ``tp-pad``, on with ``VLLM_MLA_TP_PAD=1``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.config.model.ModelConfig.verify_with_parallel_config``
    why: vLLM refuses every TP size that does not divide the attention heads
    removal: when vLLM pads heads for tensor parallelism itself

``tp_pad_weights`` (feature ``tp-pad``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.model_executor.model_loader.default_loader``
    ``.DefaultModelLoader.get_all_weights``
    why: the checkpoint holds the real widths, the padded config sizes the shards
    removal: with ``tp_pad_config``

``tp_pad_vocab`` (feature ``tp-pad``)
    versions: 0.32, 0.33, 0.34
    target: ``vllm.model_executor.layers.vocab_parallel_embedding.pad_vocab_size``
    why: vLLM divides the 64-padded vocabulary by the TP size, which 3 or 6 ranks fail
    removal: with ``tp_pad_config``

The ``sparse`` feature also registers the ``B12X_MLA_SPARSE`` backend (and ``CUSTOM``)
through ``vllm_mla.vllm.sparse.registration``, and ``sparse-cpu`` registers the CPU DSA
indexer (``SparseAttnIndexer.register_oot``) and a torch stand-in for the indexer
metadata builder's Triton kernel (``vllm.triton_utils.dispatcher.register_kernels``)
through ``vllm_mla.vllm.sparse.cpu``; those are vLLM's extension APIs, not patches.

Rules: a patch applies only if its target exists with the parameters of the installed
version (``params_at`` lists the versions where they differ); a feature's patches apply
all or none; a version where vLLM does a patch's work itself (``upstream_at``) leaves that
patch out, says so in the outcome, and applies the rest of the feature; an unsupported
vLLM version applies nothing (one warning). ``check_targets`` (``vllm-mla check-vllm``,
``scripts/check_newest_vllm.sh``) looks every target up in any vLLM, to see what a new
release moved. ``apply`` is idempotent; ``revert`` undoes everything.
An ``on_import`` patch targets a model's own package, costly to import: it is applied
when vLLM first imports that module (``vllm_mla.vllm.on_import``), so processes serving
other models never import it; its target is checked then (a warning if it is missing).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from vllm_mla.vllm import on_import

logger = logging.getLogger("vllm_mla")

SUPPORTED_VLLM = ("0.32", "0.33", "0.34")
MARK = "__vllm_mla_patch__"


@dataclass(frozen=True)
class Patch:
    """One monkeypatch: where it goes, why, and how to build the replacement."""

    name: str
    feature: str
    module: str
    qualname: str
    params: tuple[str, ...]
    versions: tuple[str, ...]
    why: str
    how: str
    removal: str
    factory: str  # "module:function" returning the replacement given the original
    requires: tuple[str, ...] = ()  # other names the replacement uses from ``module``
    platforms: tuple[str, ...] = ()  # vLLM device types it applies on (empty: all)
    # applied when ``module`` is first imported, not by ``apply`` (a model's own package,
    # costly to import, that most processes never load); applied at once if imported
    on_import: bool = False
    # versions whose target takes other parameters: ((minor, params), ...)
    params_at: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # versions where vLLM does what the patch did: ((minor, what vLLM does), ...); the
    # patch is not applied there, the rest of its feature is
    upstream_at: tuple[tuple[str, str], ...] = ()
    # the target is a pydantic model validator: its compiled schema holds the function,
    # so installing (and reverting) also rebinds it there and rebuilds the schema
    pydantic_validator: bool = False

    def params_for(self, minor: str | None) -> tuple[str, ...]:
        """The target's parameters in vLLM ``minor`` (the default where none is listed)."""
        return dict(self.params_at).get(minor, self.params)

    def upstream_in(self, minor: str | None) -> str | None:
        """What vLLM ``minor`` does itself in the patch's place (None: the patch applies)."""
        return dict(self.upstream_at).get(minor)

    def versions_text(self) -> str:
        """The registry docstring's ``versions:`` line, derived from the fields."""
        text = ", ".join(self.versions)
        for minor, params in self.params_at:
            text += f"; on {minor} the target's parameters are ({', '.join(params)})"
        for minor, what in self.upstream_at:
            text += f"; not applied on {minor}: {what}"
        return text

    def build(self, original: Callable) -> Callable:
        mod, func = self.factory.split(":")
        replacement = getattr(importlib.import_module(mod), func)(original)
        setattr(replacement, MARK, self.name)
        replacement.__wrapped__ = original
        return replacement


# vLLM 0.32's deepseek_v32 fused_norm_rope: 0.33's parameters without skip_scale
_FUSED_NORM_ROPE_032 = (
    "positions",
    "q_c",
    "q_rms_norm_w",
    "q_rms_eps",
    "kv_c",
    "kv_rms_norm_w",
    "kv_rms_eps",
    "k_pe",
    "k_rope_cos_sin_cache",
    "index_k",
    "index_k_layer_norm_w",
    "index_k_layer_norm_bias",
    "index_k_layer_norm_eps",
    "index_k_rope_cos_sin_cache",
    "topk_indices_buffer",
    "slot_mapping",
    "indexer_slot_mapping",
    "indexer_k_cache",
    "indexer_cache_shuffled",
    "mla_kv_cache",
    "mla_kv_cache_dtype",
    "mla_k_scale",
    "has_indexer",
    "index_rope_interleave",
    "q_c_out",
    "kv_c_out",
    "k_pe_out",
    "index_k_out",
)

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="mla_post_load",
        feature="lifecycle",
        module="vllm.model_executor.layers.attention.mla_attention",
        qualname="MLAAttention.process_weights_after_loading",
        params=("self", "act_dtype"),
        versions=SUPPORTED_VLLM,
        # 0.34: the activation dtype is the layer's act_dtype, set at construction
        params_at=(("0.34", ("self",)),),
        why="upstream keeps the quantized kv_b_proj and a BF16 copy, allocated after "
        "dequant scratch has churned the allocator",
        how="runs vllm_mla.weights.post_load (preallocate, bounded chunks, capability-gated "
        "release; a kept dense source in the activation dtype is aliased as upstream does) for "
        "the generic absorbed path, or binds MXFP8 views of the pack (VLLM_MLA_ABSORBED=direct); "
        "where the safe BMM is needed the pair is bound as routed weights; AMX and aiter layers "
        "go to the original untouched",
        removal="when upstream MLA post-load preallocates the pair, bounds dequant scratch and "
        "releases kv_b_proj by backend capability",
        factory="vllm_mla.vllm.patches.mla_post_load:make_process_weights_after_loading",
        requires=(
            "get_dcp_group",
            "resolve_quant_method",
            "should_load_quant_weights",
            "set_default_quant_scales",
        ),
    ),
    Patch(
        name="reload_released",
        feature="lifecycle",
        module="vllm.model_executor.model_loader.reload.layerwise",
        qualname="_copy_and_restore_kernel_tensors",
        params=("layer", "info"),
        versions=SUPPORTED_VLLM,
        why="reload copies new weights into the old parameters, and a released kv_b_proj "
        "source is an empty placeholder",
        how="rebinds only placeholders marked released to the fresh tensor, then runs the "
        "original; the attention post-load re-materializes in place and releases again",
        removal="when vLLM's reload rebinds size-changed kernel tensors itself",
        factory="vllm_mla.vllm.patches.reload_released:make_copy_and_restore",
    ),
    Patch(
        name="hyv4_sink_reload",
        feature="lifecycle",
        module="vllm.models.hy_v4.nvidia.model",
        qualname="HYV4Model.load_weights",
        params=("self", "weights"),
        versions=SUPPORTED_VLLM,
        upstream_at=(
            ("0.33", "its sink has a weight loader (make_attention_sink)"),
            ("0.34", "its sink has a weight loader (make_attention_sink)"),
        ),
        why="it copies the learnable sink past any weight_loader, so a layerwise reload "
        "counts nothing loaded and puts the old sink back",
        how="the sink entries are held back from the original and loaded through the "
        "parameter's weight_loader (the original's head-shard copy, set on first load), "
        "which the reload wrapper counts and copies into the same storage",
        removal="with vLLM 0.32",
        factory="vllm_mla.vllm.patches.hyv4_sink_reload:make_load_weights",
        on_import=True,
    ),
    Patch(
        name="dsv4_sink_reload",
        feature="lifecycle",
        module="vllm.models.deepseek_v4.cpu.model",
        qualname="DeepseekV4Model.load_weights",
        params=("self", "weights"),
        versions=SUPPORTED_VLLM,
        upstream_at=(
            ("0.33", "its sink has a weight loader (make_attention_sink)"),
            ("0.34", "its sink has a weight loader (make_attention_sink)"),
        ),
        why="it copies the attention sink past any weight_loader, so a layerwise reload counts "
        "nothing loaded and puts the old sink back",
        how="the sink entries are held back and loaded through the parameter's weight_loader "
        "(hyv4_sink_reload.sinks_through_their_loader)",
        removal="with vLLM 0.32",
        factory="vllm_mla.vllm.patches.dsv4_sink_reload:make_load_weights",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_moe_reload_prepack",
        feature="lifecycle-cpu",
        module="vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
        qualname="UnquantizedFusedMoEMethod._setup_kernel",
        params=("self", "layer", "w13", "w2"),
        versions=SUPPORTED_VLLM,
        why="a weight update skips the experts' post-load, which on CPU prepacks w13/w2, so "
        "reloaded experts are read unpacked",
        how="after the original, on a weight update served by vLLM CPU's experts, their "
        "process_weights_after_loading runs on the new weights; other experts untouched",
        removal="when vLLM re-runs the experts' post-load on weight updates",
        factory="vllm_mla.vllm.patches.cpu_moe_reload_prepack:make_setup_kernel",
        platforms=("cpu",),
    ),
    Patch(
        name="glm5next_reload",
        feature="lifecycle",
        module="vllm.model_executor.model_loader.reload.layerwise",
        qualname="finalize_layerwise_processing",
        params=("model", "model_config"),
        versions=SUPPORTED_VLLM,
        upstream_at=(
            (
                "0.34",
                "the indexer refills _wp_fp32 in its process_weights_after_loading and the "
                "KDA convolutions are one fused parameter",
            ),
        ),
        why="GLM-5.3-Flash's indexer (fp32 head weights) and KDA layers (merged convolution "
        "weights) keep copies made at their first forward, so after a reload they serve the "
        "old weights",
        how="after the original, every such copy is refilled in place from the reloaded "
        "weights (vLLM's own expressions)",
        removal="with vLLM 0.33",
        factory="vllm_mla.vllm.patches.glm5next_reload:make_finalize",
    ),
    Patch(
        name="mla_v_up_proj",
        feature="query",
        module="vllm.model_executor.layers.attention.mla_attention",
        qualname="MLAAttention._v_up_proj",
        params=("self", "x", "out"),
        versions=SUPPORTED_VLLM,
        why="cuBLAS batched BF16 GEMM reads past strided operands on SM120/121 (Xid 31)",
        how="on SM12x, with the needs_safe_query_bmm capability or VLLM_MLA_SAFE_BMM=always, "
        "the generic path runs safe_mla_query_bmm; a routed W_UV (safe or direct mode) and "
        "everything else run the original, untouched",
        removal="when cuBLAS or upstream's _v_up_proj is safe on SM12x",
        factory="vllm_mla.vllm.patches.mla_v_up_proj:make_v_up_proj",
    ),
    Patch(
        name="sparse_kv_cache_dtype",
        feature="sparse",
        module="vllm.model_executor.layers.attention.mla_attention",
        qualname="_canonicalize_sparse_mla_kv_cache_dtype",
        params=("attn_backend", "kv_cache_dtype"),
        versions=SUPPORTED_VLLM,
        why="upstream maps auto/fp8 to fp8_ds_mla only for FLASHMLA_SPARSE and "
        "FLASHINFER_MLA_SPARSE_SM120, matched by name",
        how="for a backend named B12X_MLA_SPARSE, auto/fp8/fp8_e4m3 become fp8_ds_mla; "
        "everything else goes to the original",
        removal="when upstream canonicalises by a backend attribute instead of by name",
        factory="vllm_mla.vllm.patches.sparse_kv_cache_dtype:make_canonicalize",
    ),
    Patch(
        name="dsv32_bf16_cache",
        feature="sparse",
        module="vllm.model_executor.models.config",
        qualname="DeepseekV32ForCausalLM.verify_and_update_config",
        params=("cls", "vllm_config"),
        versions=SUPPORTED_VLLM,
        why="it turns an explicit bfloat16 KV cache into auto for DSA checkpoints (fp32 on "
        "an fp32 model)",
        how="the original runs; with B12X_MLA_SPARSE selected a bfloat16 request is put back",
        removal="when upstream keeps an explicit bfloat16 cache dtype",
        factory="vllm_mla.vllm.patches.dsv32_bf16_cache:make_verify_and_update_config",
    ),
    Patch(
        name="sparse_backend_portable",
        feature="sparse",
        module="vllm.config.vllm",
        qualname="VllmConfig.try_verify_and_update_config",
        params=("self",),
        versions=SUPPORTED_VLLM,
        why="processes that unpickle the config before loading plugins cannot resolve the "
        "plugin-made B12X_MLA_SPARSE enum member",
        how="after the original, a named B12X_MLA_SPARSE becomes CUSTOM when CUSTOM is "
        "registered to the same class",
        removal="when vLLM loads general plugins before it builds or unpickles configs",
        factory="vllm_mla.vllm.patches.sparse_backend_portable:make_try_verify_and_update_config",
    ),
    Patch(
        name="mtp_draft_backend",
        feature="sparse",
        module="vllm.v1.spec_decode.llm_base_proposer",
        qualname="SpecDecodeBaseProposer._create_draft_vllm_config",
        params=("self",),
        versions=("0.32", "0.33"),
        upstream_at=(
            (
                "0.34",
                "vLLM 0.34 builds the draft from the target's config "
                "(SpeculativeConfig.apply_draft_overrides overrides the attention backend "
                "only when speculative_config.attention_backend is set), so an MTP draft "
                "keeps B12X_MLA_SPARSE",
            ),
        ),
        why="an MTP draft never inherits its target's attention backend, and auto-selection "
        "knows no out-of-tree backend",
        how="after the original, a DSA draft whose backend was left unset gets the target's "
        "B12X_MLA_SPARSE; an explicit speculative_config.attention_backend is kept",
        removal="when vLLM lets a draft inherit an out-of-tree backend of its target",
        factory="vllm_mla.vllm.patches.mtp_draft_backend:make_create_draft_vllm_config",
    ),
    Patch(
        name="cpu_sparse_backend",
        feature="sparse-cpu",
        module="vllm.platforms.cpu",
        qualname="CpuPlatform.get_attn_backend_cls",
        params=("cls", "selected_backend", "attn_selector_config", "num_heads"),
        versions=SUPPORTED_VLLM,
        why="the CPU platform refuses every sparse model before looking at the selection",
        how="sparse + B12X_MLA_SPARSE selected -> its class path; everything else: original",
        removal="when the CPU platform lets a selected out-of-tree sparse backend through",
        factory="vllm_mla.vllm.patches.cpu_sparse_backend:make_get_attn_backend_cls",
        platforms=("cpu",),
    ),
    Patch(
        name="cpu_sparse_block_size",
        feature="sparse-cpu",
        module="vllm.platforms.cpu",
        qualname="CpuPlatform.check_and_update_config",
        params=("cls", "vllm_config"),
        versions=SUPPORTED_VLLM,
        why="MLA on CPU gets block_size 16 (128 on AMX); 64-row pages are needed",
        how="after the original, a DSA model with B12X_MLA_SPARSE gets block_size 64",
        removal="when the CPU platform asks the selected backend for its block size",
        factory="vllm_mla.vllm.patches.cpu_sparse_block_size:make_check_and_update_config",
        platforms=("cpu",),
    ),
    Patch(
        name="cpu_indexer_query_quant",
        feature="sparse-cpu",
        module="vllm.model_executor.models.deepseek_v2",
        qualname="per_token_group_quant_fp8",
        params=(
            "x",
            "group_size",
            "eps",
            "dtype",
            "column_major_scales",
            "tma_aligned_scales",
            "out_q",
            "use_ue8m0",
        ),
        versions=SUPPORTED_VLLM,
        why="the DSA indexer's query quantization needs Triton off CUDA/XPU",
        how="CPU tensors go through vllm_mla.ops.sparse_indexer.quantize_rows (same rule)",
        removal="when vLLM ships a CPU per_token_group_fp8_quant",
        factory="vllm_mla.vllm.patches.cpu_indexer_query_quant:make_per_token_group_quant_fp8",
        platforms=("cpu",),
    ),
    Patch(
        name="cpu_indexer_query_quant_hy_v4",
        feature="sparse-cpu",
        module="vllm.models.hy_v4.nvidia.attention",
        qualname="per_token_group_quant_fp8",
        params=(
            "x",
            "group_size",
            "eps",
            "dtype",
            "column_major_scales",
            "tma_aligned_scales",
            "out_q",
            "use_ue8m0",
        ),
        versions=SUPPORTED_VLLM,
        why="HY-V4's indexer quantizes its query through its own import of the function",
        how="the cpu_indexer_query_quant replacement, under HY-V4's name",
        removal="when vLLM ships a CPU per_token_group_fp8_quant",
        factory=(
            "vllm_mla.vllm.patches.cpu_indexer_query_quant_hy_v4:make_per_token_group_quant_fp8"
        ),
        platforms=("cpu",),
    ),
    Patch(
        name="cpu_glm5next_indexer_weights",
        feature="sparse-cpu",
        module="vllm.models.glm5next.common.attention",
        qualname="Indexer.__init__",
        params=(
            "self",
            "vllm_config",
            "config",
            "hidden_size",
            "q_lora_rank",
            "quant_config",
            "cache_config",
            "topk_indices_buffer",
            "prefix",
        ),
        versions=SUPPORTED_VLLM,
        why="vLLM CPU's linear post-load packs the weight for oneDNN and leaves an empty "
        "placeholder, and GLM-5.3-Flash's indexer reads wk_weights_proj.weight in its first "
        "forward (its fp32 head weights): IndexError",
        how="after the original, marks wk_weights_proj _cpu_skip_gemm_dispatch (vLLM's own "
        "flag: the weight is kept and served by F.linear, as vLLM does for kv_b_proj)",
        removal="when vLLM CPU keeps the weights its model code reads after loading",
        factory="vllm_mla.vllm.patches.cpu_glm5next_indexer_weights:make_init",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_glm5next_kda_chunk",
        feature="sparse-cpu",
        module="vllm.models.glm5next.common.kda",
        qualname="chunk_kda_with_fused_gate",
        params=(
            "q",
            "k",
            "v",
            "raw_g",
            "beta",
            "A_log",
            "g_bias",
            "scale",
            "initial_state",
            "output_final_state",
            "use_qk_l2norm_in_kernel",
            "cu_seqlens",
            "safe_gate",
            "lower_bound",
            "kwargs",
        ),
        versions=SUPPORTED_VLLM,
        why="GLM-5.3-Flash's KDA prefill is Triton, which vLLM CPU runs without",
        how="CPU tensors through vllm_mla.ops.kda.reference.chunk_with_fused_gate (vLLM's "
        "recurrence in fp32, its [H, V, K] state layout)",
        removal="when vLLM CPU serves KDA layers",
        factory="vllm_mla.vllm.patches.cpu_glm5next_kda_chunk:make_chunk_kda_with_fused_gate",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_glm5next_kda_recurrent",
        feature="sparse-cpu",
        module="vllm.models.glm5next.common.kda",
        qualname="fused_recurrent_kda",
        params=(
            "q",
            "k",
            "v",
            "g",
            "beta",
            "scale",
            "initial_state",
            "inplace_final_state",
            "use_qk_l2norm_in_kernel",
            "cu_seqlens",
            "ssm_state_indices",
            "num_accepted_tokens",
            "out",
            "sigmoid_beta",
            "a_log",
            "g_bias",
            "compute_gate",
            "lower_bound",
            "kwargs",
        ),
        versions=SUPPORTED_VLLM,
        why="GLM-5.3-Flash's KDA decode and speculative verification are Triton",
        how="CPU tensors through vllm_mla.ops.kda.reference.fused_recurrent (the kernel's "
        "state slots, accepted-token start and null-slot rule)",
        removal="when vLLM CPU serves KDA layers",
        factory="vllm_mla.vllm.patches.cpu_glm5next_kda_recurrent:make_fused_recurrent_kda",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_glm5next_kda_gather",
        feature="sparse-cpu",
        module="vllm.models.glm5next.common.kda",
        qualname="gather_initial_states",
        params=("state", "indices", "has_initial_state"),
        versions=SUPPORTED_VLLM,
        why="it asserts a CUDA or XPU state before its Triton kernel",
        how="CPU tensors: the rows at the indices, zeros where there is no initial state",
        removal="when vLLM CPU serves KDA layers",
        factory="vllm_mla.vllm.patches.cpu_glm5next_kda_gather:make_gather_initial_states",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_glm5next_kda_scatter",
        feature="sparse-cpu",
        module="vllm.models.glm5next.common.kda",
        qualname="scatter_states",
        params=("state", "src", "indices"),
        versions=SUPPORTED_VLLM,
        why="it asserts a CUDA state before its Triton kernel",
        how="CPU tensors: state[indices] = src; the original's register_warmup kept",
        removal="when vLLM CPU serves KDA layers",
        factory="vllm_mla.vllm.patches.cpu_glm5next_kda_scatter:make_scatter_states",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_glm5next_mhc_pre",
        feature="sparse-cpu",
        module="vllm.models.glm5next.common.model",
        qualname="Glm5NextDecoderLayer.hc_pre",
        params=("self", "x", "hc_fn", "hc_scale", "hc_base", "norm_weight", "norm_eps"),
        versions=SUPPORTED_VLLM,
        why="vLLM CPU's mHC pre op drops the layer's input RMSNorm (and is in _C only)",
        how="CPU tensors: the original with the op's torch forward_native, then vLLM's "
        "_apply_mhc_norm on the layer input",
        removal="when vLLM's CPU mHC ops apply ``norm_weight``",
        factory="vllm_mla.vllm.patches.cpu_glm5next_mhc_pre:make_hc_pre",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_glm5next_mhc_fused_post_pre",
        feature="sparse-cpu",
        module="vllm.models.glm5next.common.model",
        qualname="Glm5NextDecoderLayer.hc_fused_post_pre",
        params=(
            "self",
            "x",
            "residual",
            "post",
            "comb",
            "hc_fn",
            "hc_scale",
            "hc_base",
            "norm_weight",
            "norm_eps",
        ),
        versions=SUPPORTED_VLLM,
        why="vLLM CPU's fused mHC post + pre op drops the RMSNorm it is passed",
        how="CPU tensors: the original with the op's torch forward_native, then vLLM's "
        "_apply_mhc_norm on the layer input",
        removal="when vLLM's CPU mHC ops apply ``norm_weight``",
        factory="vllm_mla.vllm.patches.cpu_glm5next_mhc_fused_post_pre:make_hc_fused_post_pre",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_glm5next_mhc_post",
        feature="sparse-cpu",
        module="vllm.models.glm5next.common.model",
        qualname="Glm5NextDecoderLayer.hc_post",
        params=("self", "x", "residual", "post", "comb"),
        versions=SUPPORTED_VLLM,
        why="vLLM CPU's mHC post op is in _C only (not _C_AVX2 / _C_AVX512)",
        how="CPU tensors: the original with the op's torch forward_native (mhc_post_torch)",
        removal="when vLLM CPU's mHC post op runs on every host it loads",
        factory="vllm_mla.vllm.patches.cpu_glm5next_mhc_post:make_hc_post",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_dsv4_kernels",
        feature="sparse-cpu",
        module="vllm.models.deepseek_v4.cpu.model",
        qualname="DeepseekV4ForCausalLM.__init__",
        params=("self", "vllm_config", "prefix"),
        versions=SUPPORTED_VLLM,
        why="vLLM CPU's V4 kernels are in _C only; elsewhere V4 stops at its first kernel call",
        how="sparse.dsv4_cpu.refusal() first: our torch kernels defined where the library "
        "lacks them, any still missing named (library, ISA cap) and raised",
        removal="when vLLM CPU's V4 kernels are built into every library it loads",
        factory="vllm_mla.vllm.patches.cpu_dsv4_kernels:make_init",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_dsv4_swa_indices",
        feature="sparse-cpu",
        module="vllm.v1.attention.backends.mla.sparse_swa",
        qualname="ComputeSWAIndicesAndLensKernel.__call__",
        params=(
            "self",
            "swa_indices",
            "swa_lens",
            "window_size",
            "index_width",
            "left_visible",
            "right_visible",
            "query_start_loc",
            "seq_lens",
            "token_to_req_indices",
            "is_valid_token",
            "block_table",
            "block_size",
            "replay_start",
            "num_tokens",
            "token_offset",
            "has_image",
        ),
        versions=SUPPORTED_VLLM,
        why="DeepSeek-V4's sliding-window indices are a Triton kernel, which vLLM CPU cannot run",
        how="CPU tensors without Triton: sparse.dsv4_cpu.swa_indices_and_lens (the kernel's "
        "rows in torch)",
        removal="when vLLM CPU serves ComputeSWAIndicesAndLensKernel without Triton",
        factory="vllm_mla.vllm.patches.cpu_dsv4_swa_indices:make_call",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="cpu_dsv4_tile_scheduler",
        feature="sparse-cpu",
        module="vllm.models.deepseek_v4.cpu.cpu_mla",
        qualname="DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler",
        params=("self", "num_decode_tokens"),
        versions=SUPPORTED_VLLM,
        why="it leaves out the c1a / c2a schedulers the shared builder reads (KeyError: 'c1a')",
        how="the original's schedulers plus None for every other _LAYER_TYPE_* of the "
        "shared builder",
        removal="when vLLM's CPU builder returns every layer type the shared builder reads",
        factory="vllm_mla.vllm.patches.cpu_dsv4_tile_scheduler:make_build_tile_scheduler",
        platforms=("cpu",),
        on_import=True,
    ),
    Patch(
        name="dsv4_gpu_capability",
        feature="dsv4-gpu",
        module="vllm.models.deepseek_v4.nvidia.model",
        qualname="_select_dsv4_attn_cls",
        params=("vllm_config",),
        versions=SUPPORTED_VLLM,
        why="it picks FlashMLA's class on every GPU but SM12x without asking the backends' "
        "declared capabilities, so V4 on SM80 / SM89 fails inside a kernel at the first step",
        how="after the original, a class whose backend declines the device's capability is "
        "refused with every V4 class's declared capabilities named",
        removal="when vLLM's V4 selector checks its backends' declared capabilities",
        factory="vllm_mla.vllm.patches.dsv4_gpu_capability:make_select",
        platforms=("cuda",),
        on_import=True,
    ),
    Patch(
        name="nvfp4_dcp_validator",
        feature="sparse",
        module="vllm.config.vllm",
        qualname="VllmConfig.validate_nvfp4_kv_cache_with_mla",
        params=("self",),
        versions=SUPPORTED_VLLM,
        upstream_at=(
            ("0.32", "its validator has no DCP refusal"),
            ("0.33", "its validator has no DCP refusal"),
        ),
        why="it refuses nvfp4_ds_mla with DCP > 1 for every backend, for a chunked-context "
        "prefill gather only FLASHMLA_SPARSE has",
        how="with B12X_MLA_SPARSE selected an nvfp4_ds_mla cache is accepted; every other "
        "config goes to the original (the validator rebound in pydantic's schema)",
        removal="when upstream scopes the refusal to the backends with that prefill gather",
        factory="vllm_mla.vllm.patches.nvfp4_dcp_validator:make_validate",
        pydantic_validator=True,
    ),
    Patch(
        name="dsv32_nvfp4_write",
        feature="sparse",
        module="vllm.models.deepseek_v32.attention",
        qualname="fused_norm_rope",
        params=(
            *_FUSED_NORM_ROPE_032,
            "skip_scale",
        ),
        versions=SUPPORTED_VLLM,
        params_at=(("0.32", _FUSED_NORM_ROPE_032),),  # no skip_scale yet
        why="with the MLA cache passed it writes nvfp4_ds_mla records with "
        "cvt.rn.satfinite.e2m1x2, SM100a/SM120a PTX: SM80/89/90 fail at the first forward",
        how="while a B12X_MLA_SPARSE layer serves nvfp4_ds_mla, the original runs without "
        "the cache and ops.sparse_mla.write_records writes kv_c_out/k_pe_out at "
        "slot_mapping (Triton, no FP4 PTX); every other call goes to the original",
        removal="when upstream's nvfp4 writer runs without FP4 PTX",
        factory="vllm_mla.vllm.patches.dsv32_nvfp4_write:make_fused_norm_rope",
        on_import=True,
    ),
    Patch(
        name="tp_pad_config",
        feature="tp-pad",
        module="vllm.config.model",
        qualname="ModelConfig.verify_with_parallel_config",
        params=("self", "parallel_config"),
        versions=SUPPORTED_VLLM,
        why="vLLM refuses every tensor-parallel size that does not divide the attention heads",
        how="before the original, vllm_mla.tp_pad.plan pads the HF config's heads and MLP "
        "widths to sizes TP divides and records the padding on it (every worker gets it)",
        removal="when vLLM pads heads for tensor parallelism itself",
        factory="vllm_mla.vllm.patches.tp_pad_config:make_verify_with_parallel_config",
    ),
    Patch(
        name="tp_pad_weights",
        feature="tp-pad",
        module="vllm.model_executor.model_loader.default_loader",
        qualname="DefaultModelLoader.get_all_weights",
        params=("self", "model_config", "model"),
        versions=SUPPORTED_VLLM,
        why="the checkpoint holds the real widths; the padded config sizes the shards",
        how="with a padding record on the config, each tensor is zero-padded by name "
        "(vllm_mla.tp_pad.pad_tensor); load and reload both read here",
        removal="with tp_pad_config",
        factory="vllm_mla.vllm.patches.tp_pad_weights:make_get_all_weights",
    ),
    Patch(
        name="tp_pad_vocab",
        feature="tp-pad",
        module="vllm.model_executor.layers.vocab_parallel_embedding",
        qualname="pad_vocab_size",
        params=("vocab_size", "pad_to"),
        versions=SUPPORTED_VLLM,
        why="vLLM divides the 64-padded vocabulary by the TP size, which 3 or 6 ranks fail",
        how="the original's size grown to a multiple of lcm(pad_to, tp) where TP does not "
        "divide it; the logits are cut back to the real vocabulary by vLLM",
        removal="with tp_pad_config",
        factory="vllm_mla.vllm.patches.tp_pad_vocab:make_pad_vocab_size",
    ),
    Patch(
        name="wake_check_sleep",
        feature="wake-check",
        module="vllm.v1.worker.gpu_worker",
        qualname="Worker.sleep",
        params=("self", "level"),
        versions=SUPPORTED_VLLM,
        why="vLLM keeps no flag for weights discarded by sleep level 2 and not reloaded",
        how="before the original, a level-2 sleep fingerprints the MLA layers and arms the check",
        removal="when vLLM refuses to serve weights discarded and not reloaded",
        factory="vllm_mla.vllm.patches.wake_check_sleep:make_sleep",
    ),
    Patch(
        name="wake_check_wake_up",
        feature="wake-check",
        module="vllm.v1.worker.gpu_worker",
        qualname="Worker.wake_up",
        params=("self", "tags"),
        versions=SUPPORTED_VLLM,
        why="the check is due once the weights are woken up after a level-2 sleep",
        how="after the original, waking the weights makes the armed check due",
        removal="with wake_check_sleep",
        factory="vllm_mla.vllm.patches.wake_check_wake_up:make_wake_up",
    ),
    Patch(
        name="wake_check_execute_model",
        feature="wake-check",
        module="vllm.v1.worker.gpu_worker",
        qualname="Worker.execute_model",
        params=("self", "scheduler_output"),
        versions=SUPPORTED_VLLM,
        why="the first step after the wake-up is the last moment before garbage is served",
        how="when the check is due, compare the MLA fingerprints once, then the original",
        removal="with wake_check_sleep",
        factory="vllm_mla.vllm.patches.wake_check_execute_model:make_execute_model",
    ),
)

_applied: dict[str, tuple[object, str, Callable, bool]] = {}
_warned_version = False


class TargetMissing(LookupError):
    """A patch target is absent or has another signature in the installed vLLM."""


def _function(descriptor: object) -> object:
    """The plain function behind a class attribute (a classmethod's ``__func__``)."""
    return descriptor.__func__ if isinstance(descriptor, classmethod) else descriptor


def resolve(patch: Patch, minor: str | None = None) -> tuple[object, str, Callable]:
    """(owner, attribute, current attribute) of ``patch``'s target, or TargetMissing.

    The attribute may be a function or a classmethod; its signature (``cls`` first for a
    classmethod) must be ``patch.params_for(minor)`` (default: the installed vLLM's minor).
    """
    expected = patch.params_for(installed_minor() if minor is None else minor)
    try:
        owner = importlib.import_module(patch.module)
    except ImportError as exc:
        raise TargetMissing(f"{patch.module} cannot be imported ({exc})") from None
    for name in patch.requires:
        if not hasattr(owner, name):
            raise TargetMissing(f"{patch.module}.{name} (used by the patch) does not exist")
    *path, attr = patch.qualname.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            raise TargetMissing(f"{patch.module}.{patch.qualname}: no {part}")
    current = inspect.getattr_static(owner, attr, None)
    func = _function(current)
    if not callable(func):
        raise TargetMissing(f"{patch.module}.{patch.qualname} does not exist")
    original = getattr(func, "__wrapped__", func) if hasattr(func, MARK) else func
    params = tuple(inspect.signature(original).parameters)
    if params != expected:
        raise TargetMissing(
            f"{patch.module}.{patch.qualname}: expected parameters {expected}, got {params}"
        )
    return owner, attr, current


def _platform() -> str | None:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return None
    return getattr(current_platform, "device_type", None)


def vllm_version() -> str | None:
    """Installed vLLM's version, or None when vLLM is not importable."""
    try:
        import vllm
    except ImportError:
        return None
    return getattr(vllm, "__version__", "unknown")


def supported(version: str) -> bool:
    return ".".join(version.split(".")[:2]) in SUPPORTED_VLLM


def installed_minor() -> str | None:
    version = vllm_version()
    return None if version is None else ".".join(version.split(".")[:2])


def vllm_minor() -> tuple[int, int]:
    """The installed vLLM's (major, minor), e.g. (0, 34); (0, 0) when it is not importable
    or its version does not parse."""
    try:
        major, minor = (installed_minor() or "").split(".")
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


def apply(features: frozenset[str]) -> dict[str, str]:
    """Apply every patch of ``features``; returns {feature: "applied ..." | "skipped: why"}."""
    global _warned_version
    version = vllm_version()
    if version is None:
        return dict.fromkeys(sorted(features), "skipped: vLLM is not importable")
    if not supported(version):
        if not _warned_version:
            logger.warning(
                "vllm-mla: vLLM %s is not one of %s; no patch applied", version, SUPPORTED_VLLM
            )
            _warned_version = True
        return dict.fromkeys(sorted(features), f"skipped: vLLM {version} unsupported")
    results = {}
    minor = ".".join(version.split(".")[:2])
    for feature in sorted(features):
        patches = [p for p in PATCHES if p.feature == feature]
        untested = [
            p.name for p in patches if minor not in p.versions and p.upstream_in(minor) is None
        ]
        # vLLM does these itself in this version: named in the outcome, not applied
        native = [p for p in patches if p.upstream_in(minor) is not None]
        patches = [p for p in patches if p not in native]
        if untested:
            results[feature] = f"skipped: {', '.join(untested)} not written for vLLM {minor}"
            logger.warning("vllm-mla: feature %s not applied: %s", feature, results[feature])
            continue
        platform = _platform()
        elsewhere = sorted({q for p in patches for q in p.platforms if platform not in p.platforms})
        if elsewhere:
            results[feature] = f"skipped: for {', '.join(elsewhere)} only (platform {platform})"
            continue
        later = [p for p in patches if p.on_import and p.module not in sys.modules]
        try:
            targets = [(p, *resolve(p, minor)) for p in patches if p not in later]
        except TargetMissing as exc:
            logger.warning("vllm-mla: feature %s not applied: %s", feature, exc)
            results[feature] = f"skipped: {exc}"
            continue
        for patch, owner, attr, current in targets:
            _install(patch, owner, attr, current)
        for patch in later:
            on_import.when_imported(patch.module, functools.partial(_apply_on_import, patch))
        results[feature] = "applied " + ", ".join(
            p.qualname + (f" (when {p.module} is imported)" if p in later else "") for p in patches
        )
        if not patches:
            results[feature] = "applied (nothing to patch)"
        for patch in native:
            results[feature] += f"; {patch.name} not needed: {patch.upstream_in(minor)}"
    return results


def check_targets() -> dict[str, list[tuple[str, str]]]:
    """Every patch's target looked up in the installed vLLM, whatever its version (the
    version gate applies nothing to an unknown one; this says what would have to move):
    ``{feature: [(patch, "ok" | "not needed: ..." | "moved: ...")]}``. An unknown version
    is judged against the newest supported version's signatures."""
    minor = installed_minor()
    judged = minor if minor in SUPPORTED_VLLM else SUPPORTED_VLLM[-1]
    found: dict[str, list[tuple[str, str]]] = {}
    for patch in PATCHES:
        if patch.upstream_in(judged) is not None:
            outcome = f"not needed: {patch.upstream_in(judged)}"
        else:
            try:
                resolve(patch, judged)
                outcome = "ok"
            except TargetMissing as exc:
                outcome = f"moved: {exc}"
        found.setdefault(patch.feature, []).append((patch.name, outcome))
    return found


def _install(patch: Patch, owner: object, attr: str, current: object) -> None:
    func = _function(current)
    if hasattr(func, MARK):  # already ours: idempotent
        return
    replacement = patch.build(func)
    if isinstance(current, classmethod):
        replacement = classmethod(replacement)
    setattr(owner, attr, replacement)
    if patch.pydantic_validator:
        _rebind_validator(owner, attr, replacement)
    _applied[patch.name] = (owner, attr, current, patch.pydantic_validator)


def _rebind_validator(owner: type, attr: str, func: Callable) -> None:
    """Point pydantic's decorator entry ``attr`` of ``owner`` at ``func`` and rebuild the
    dataclass schema, so validation calls ``func`` (the schema captured the old one)."""
    import dataclasses

    from pydantic.dataclasses import rebuild_dataclass

    validators = owner.__pydantic_decorators__.model_validators  # type: ignore[attr-defined]
    validators[attr] = dataclasses.replace(validators[attr], func=func)
    rebuild_dataclass(owner, force=True)  # type: ignore[arg-type]


def _apply_on_import(patch: Patch, module: object) -> None:
    """An ``on_import`` patch, once its module is imported; a missing target is logged
    (the feature's other patches are in place by then)."""
    try:
        _install(patch, *resolve(patch))
    except TargetMissing as exc:
        logger.warning("vllm-mla: patch %s not applied: %s", patch.name, exc)
        return
    logger.debug("vllm-mla: patch %s applied on import of %s", patch.name, patch.module)


def revert() -> None:
    """Put every original back (tests, or a process that wants stock vLLM again)."""
    for owner, attr, original, validator in _applied.values():
        setattr(owner, attr, original)
        if validator:
            _rebind_validator(owner, attr, _function(original))  # type: ignore[arg-type]
    _applied.clear()
    on_import.cancel({p.module for p in PATCHES if p.on_import})  # patches not yet applied
