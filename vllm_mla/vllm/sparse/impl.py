"""``B12XMLASparseImpl``: vLLM's sparse-MLA impl contract, none of its generic owners.

What it does (vLLM 0.33's impl contract):

- MQA-only (``supports_dense_mha_prefill=False``): the layer sets no prefill backend
  and every token reaches ``forward_mqa``; the lifecycle then releases kv_b_proj's
  sources (capability ``B12X_MLA_SPARSE`` in ``vllm_mla.vllm.capabilities``).
- Top-k: logical positions from the indexer-owned buffer, resolved every call
  (``TopkSelection``); converted to physical rows by vLLM's Triton kernel on GPU and
  by ``logical_to_physical`` elsewhere.
- Owns none of ``SparseMLACommonImpl``'s allocations: no index-group conversion
  buffers, side stream or events (it never calls ``register_layer``), no shadow
  selection buffer.
- Preparation: in ``process_weights_after_loading`` (before vLLM's profiling
  capture), one plan per distinct capacity set is prepared on probes that die with
  it; the session freezes once vLLM locks its workspace (after capture).
- b12x: construction calls ``b12x_runner.install()`` (registers the b12x runner when
  b12x imports), so ``select_impl`` picks b12x on SM120/121.
- Scratch: from vLLM's workspace manager (shared across layers), sized from the
  declared capacities; reserved during the profile run.
- Decode context parallelism (``decode_context_parallel_size`` N > 1, any
  ``cp_kv_cache_interleave_size`` vLLM allows): vLLM gathers the query heads of the DCP
  group (``forward_mqa`` sees N x the layer's heads), the indexer selects request
  positions of the whole group, and each rank attends to the selected positions its
  shard holds (``ops.dcp.DCPShard``: filtered and localized in the Triton kernel, or by
  ``logical_to_physical`` for the physical-row plans), returning ``(out, lse)`` with the
  natural-log LSE ``[T, N*H]`` (token-major, fp32; a row with none of this rank's tokens:
  out 0, lse -inf) that vLLM's ``dcp_manager.combine`` merges. b12x declines DCP
  (``serving_impl``): its empty-row contract is unverified, and under DCP a row with none
  of a rank's tokens is routine, so Triton serves. Not served, refused at start-up with
  the setting named: PCP (vLLM, by ``supports_pcp``). Speculative decoding (MTP, ngram)
  under DCP is served: every decode token is a query row of its own with its own causal
  bound, the indexer merges each token's candidates, and vLLM merges each token's rows by
  their LSE. On vLLM CPU two of vLLM's DCP kernels are Triton or refuse context
  parallelism; ``cpu_dcp`` stands in for them.
- Attention sink (HY-V4): vLLM's ``MLAAttention`` hands the layer's learnable sink as the
  ``sinks`` kwarg (``HYV4MLAAttention``: an fp32 ``[heads]`` Parameter, the local TP
  shard, raw logits loaded after construction). The impl keeps that Parameter (never a
  copy: the weights load into it later) and passes it to every kernel call, where it
  joins each head's softmax denominator once (``ops.sparse_mla``, ``sink=``); the plan
  declares it (``SparseMLACaps.sink``) so its variant is prepared. b12x has no sink input
  and declines (``serving_impl``): Triton serves. Under DCP the calls see the group's
  heads, so the impl gathers the group's sinks (``dcp_sinks``, at every post-load, reloads
  included: nothing per step) and counts them once in the merged softmax: DCP rank 0
  passes them, the other ranks pass -inf (no sink), so the LSE merge adds ``e^sink`` to
  the group's denominator once. Refused at start-up, named (``served.refuse_layer``): a
  sinks tensor not fp32 ``[heads]``.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.v1.attention.backend import MLAAttentionImpl

from vllm_mla.formats import ROPE
from vllm_mla.formats import SPARSE_BACKEND as NAME
from vllm_mla.ops.dcp import NO_DCP, DCPShard
from vllm_mla.ops.sparse_mla import (
    LATENT,
    PreparationSession,
    SparseMLACaps,
    SparseMLAPlan,
    TopkSelection,
    b12x_runner,
    logical_to_physical,
    write_records,
)
from vllm_mla.ops.sparse_mla.formats import FORMAT, FORMAT_OF_CACHE_DTYPE
from vllm_mla.ops.sparse_mla.preparation import BoundCall
from vllm_mla.ops.sparse_mla.record_write import TRITON_WRITERS
from vllm_mla.vllm import telemetry
from vllm_mla.vllm.sparse.served import refuse_layer, topk_buffer_width

logger = logging.getLogger("vllm_mla")

KV_FORMAT_OF = FORMAT_OF_CACHE_DTYPE  # vLLM cache dtype -> record format (the table's)
SERVED_MODEL_DTYPES = (torch.bfloat16, torch.float32)  # queries the op takes
# (scratch, out [T, H, 512], lse [T, H] fp32 under DCP else None) of one step
StepBuffers = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
_sessions: dict[torch.device, PreparationSession] = {}
_plans: dict[tuple[torch.device, SparseMLACaps, str | None], SparseMLAPlan] = {}
B12X_DCP_DECLINED = (
    "b12x declines DCP: a row with none of this rank's selected tokens must give out 0 and "
    "lse -inf (the identity of vLLM's LSE merge), unverified for b12x, and routine under "
    "DCP; the Triton kernel serves"
)
B12X_SINK_DECLINED = (
    "b12x declines the attention sink (its sparse-MLA Caps and bind take none); the Triton "
    "kernel serves"
)
B12X_NOPE_DECLINED = (
    "b12x declines qk_rope_head_dim 0 (its GLM_NSA records carry a 64-wide RoPE); the "
    "Triton kernel serves"
)


def session_for(device: torch.device) -> PreparationSession:
    """The process-wide preparation session of ``device`` (one per device)."""
    if device not in _sessions:
        _sessions[device] = PreparationSession(device)
    return _sessions[device]


def plan_for(device: torch.device, caps: SparseMLACaps, impl: str | None = None) -> SparseMLAPlan:
    """One plan per (device, capacities, implementation; None: the device's choice):
    layers with equal capacities share it."""
    key = (device, caps, impl)
    if key not in _plans:
        _plans[key] = session_for(device).plan(caps, impl)
    return _plans[key]


def b12x_format_declined(kv_format: str) -> str | None:
    """Why b12x declines ``kv_format`` (None: it has that record, the table's recipe)."""
    if FORMAT[kv_format].b12x_recipe is not None:
        return None
    return (
        f"b12x declines kv_format {kv_format!r} (b12x {b12x_runner.B12X_VERSION} reads no "
        f"such record; its sparse-MLA recipes: {sorted(b12x_runner.B12X_RECIPE.values())}); "
        "the Triton kernel serves"
    )


def serving_impl(
    chosen: str,
    dcp_world_size: int = 1,
    sink: bool = False,
    rope: int = ROPE,
    kv_format: str = "fp8_ds_mla",
) -> str:
    """The implementation this backend's plans use where the kernel chooses ``chosen``
    (``select_impl``): the same, except that under DCP (``B12X_DCP_DECLINED``), with an
    attention sink (``B12X_SINK_DECLINED``), without RoPE (``B12X_NOPE_DECLINED``) and for
    a record b12x does not read (``b12x_format_declined``: bf16, nvfp4_ds_mla) b12x
    declines and Triton serves."""
    impl = chosen
    declined = b12x_format_declined(kv_format)
    if impl == "b12x" and declined is not None:
        logger.info("vllm-mla: %s: %s", NAME, declined)
        return "triton"
    if impl == "b12x" and rope != ROPE:
        logger.info("vllm-mla: %s: %s", NAME, B12X_NOPE_DECLINED)
        return "triton"
    if impl == "b12x" and dcp_world_size > 1:
        logger.info("vllm-mla: %s: %s", NAME, B12X_DCP_DECLINED)
        return "triton"
    if impl == "b12x" and sink:
        logger.info("vllm-mla: %s: %s", NAME, B12X_SINK_DECLINED)
        return "triton"
    return impl


def dcp_shard(dcp_world_size: int, dcp_rank: int, parallel_config: object = None) -> DCPShard:
    """This rank's ``DCPShard``: vLLM's DCP size and rank, ``parallel_config``'s
    ``cp_kv_cache_interleave_size`` (1 without one). vLLM may adjust the interleave after
    the layers are built (``adjust_dcp_kv_cache_interleave_size``, before any forward),
    so callers read it again when they bind their first forward."""
    if dcp_world_size <= 1:
        return NO_DCP
    interleave = int(getattr(parallel_config, "cp_kv_cache_interleave_size", 1))
    return DCPShard(int(dcp_world_size), int(dcp_rank), interleave)


def _dcp_on_this_platform() -> None:
    """vLLM CPU runs DCP with two torch stand-ins (``cpu_dcp``), installed here: after
    vLLM's worker registered its own CPU kernels, before the first step."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_mla.vllm.sparse import cpu_dcp

        cpu_dcp.install()


def _parallel_config() -> object:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    return None if config is None else config.parallel_config


def reset_sessions() -> None:
    """Forget every session and plan (tests; a process that unloads the model)."""
    for (device, *_), plan in list(_plans.items()):
        _sessions[device].release(plan)
    _plans.clear()
    _sessions.clear()


def kv_format_of(kv_cache_dtype: str, model_dtype: torch.dtype = torch.bfloat16) -> str:
    """The kernel's cache format for a vLLM cache dtype, or a typed error saying why not.

    ``auto`` is the model dtype, so it is served as bf16 records only for a bf16 model.
    """
    if kv_cache_dtype not in KV_FORMAT_OF:
        raise NotImplementedError(
            f"{NAME}: kv_cache_dtype {kv_cache_dtype!r} is not served (expected one of "
            f"{sorted(KV_FORMAT_OF)}); fp8/fp8_e4m3 become fp8_ds_mla only with the "
            "vllm-mla 'sparse' feature on, else pass --kv-cache-dtype fp8_ds_mla"
        )
    if kv_cache_dtype == "auto" and model_dtype != torch.bfloat16:
        raise NotImplementedError(
            f"{NAME}: kv_cache_dtype 'auto' is the model dtype ({model_dtype}), a cache this "
            "backend does not read; pass --kv-cache-dtype fp8 (fp8_ds_mla records) or, where "
            "vLLM allows a bf16 cache for this model dtype (vLLM 0.32), bfloat16"
        )
    return KV_FORMAT_OF[kv_cache_dtype]


def _model_dtype() -> torch.dtype:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    model = getattr(config, "model_config", None) if config is not None else None
    return getattr(model, "dtype", torch.bfloat16) if model is not None else torch.bfloat16


class B12XMLASparseImpl(MLAAttentionImpl, SharedTopkIndicesBuffer):
    """Sparse MLA through ``vllm_mla.ops.sparse_mla`` with explicit owners."""

    is_sparse: ClassVar[bool] = True
    supports_dense_mha_prefill: ClassVar[bool] = False
    supports_quant_query_input: bool = False
    supports_pcp: bool = False
    # DCP: forward_mqa returns the natural-log decode LSE (lse_base_on_e) of this rank's
    # shard when vLLM sets need_to_return_lse_for_decode (module docstring).
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True
    # MTP with an interleave > 1: vLLM asks because a backend that localizes a request's
    # length before expanding its drafted tokens gets too-short bounds. Ours takes no
    # length: each token's selected request positions (the indexer's, bounded per token by
    # vLLM's per-token localization) are mapped to this rank's rows (DCPShard.to_local).
    supports_mtp_with_cp_non_trivial_interleave_size: bool = True
    # upstream reads these off sparse impls
    masked_mha_available: bool = False
    index_group = None
    index_group_index = 0

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        *,
        kv_lora_rank: int = 512,
        qk_rope_head_dim: int = 64,
        kv_b_proj: Any = None,
        indexer: object | None = None,
        topk_indices_buffer: torch.Tensor | None = None,
        **mla_args: Any,
    ) -> None:
        # Anything but what the backend declares (backend.SERVES) is refused here, named:
        # the sliding window and sinks never reach vLLM's selector. dcp_world_size: set by
        # vLLM's AttentionImplBase.__new__.
        sinks = mla_args.pop("sinks", None)
        refuse_layer(
            head_size=head_size,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            num_kv_heads=num_kv_heads,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            attn_type=attn_type,
            kv_sharing_target_layer_name=kv_sharing_target_layer_name,
            sinks=sinks,
            num_heads=num_heads,
            dcp_size=self.dcp_world_size,
        )
        # fp32 [H]: the model's Parameter itself, read at every call (its weights load
        # after construction); None: no sink
        self.sinks: torch.Tensor | None = sinks
        # what the kernel calls pass: the sinks, or under DCP the group's (dcp_sinks)
        self._call_sinks: torch.Tensor | None = sinks
        # index_group_builder (and any other generic sparse argument) is accepted and
        # deliberately unused: registering with it allocates group conversion buffers,
        # a side stream and two events per indexer layer that this impl never reads.
        mla_args.pop("index_group_builder", None)
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_nope_head_dim = mla_args.get("qk_nope_head_dim")
        self.v_head_dim = mla_args.get("v_head_dim")
        self.kv_b_proj = kv_b_proj  # the module; the lifecycle releases its sources
        self.model_dtype = _model_dtype()
        if self.model_dtype not in SERVED_MODEL_DTYPES:
            raise NotImplementedError(
                f"{NAME}: model dtype {self.model_dtype} is not served; expected one of "
                f"{SERVED_MODEL_DTYPES}"
            )
        self.kv_format = kv_format_of(kv_cache_dtype, self.model_dtype)
        if self.kv_format in TRITON_WRITERS:  # DSv3.2's fused write: ours (patch)
            from vllm_mla.vllm.patches import dsv32_nvfp4_write

            dsv32_nvfp4_write.serve()
        # Before planning (process_weights_after_loading -> select_impl): with b12x
        # installed, SM120/121 gets its kernels; without it this is a no-op.
        b12x_runner.install()
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)
        # dcp_world_size / dcp_rank: set by vLLM's AttentionImplBase.__new__
        self._parallel = _parallel_config()  # vLLM's object: its interleave is read again
        self.dcp = dcp_shard(self.dcp_world_size, self.dcp_rank, self._parallel)
        if not self.dcp.trivial:
            _dcp_on_this_platform()
        # Under DCP vLLM gathers the query heads of the whole DCP group (query_gather).
        self.caps = self._declare_caps(
            num_heads * self.dcp.size, topk_indices_buffer, indexer, dcp=not self.dcp.trivial
        )
        self.plan: SparseMLAPlan | None = None
        self.session: PreparationSession | None = None
        self._call: BoundCall | None = None
        self._locked_buffers: StepBuffers | None = None
        self._step_buffers: dict[int, StepBuffers] = {}

    # -- selection: only the indexer reference when the indexer owns the buffer ------
    def init_topk_indices_buffer(
        self, indexer: object | None, topk_indices_buffer: torch.Tensor | None
    ) -> None:
        self._selection = TopkSelection(indexer, topk_indices_buffer)

    @property
    def topk_indices_buffer(self) -> torch.Tensor | None:
        return self._selection.buffer()

    @topk_indices_buffer.setter
    def topk_indices_buffer(self, buffer: torch.Tensor | None) -> None:
        self._selection.set_buffer(buffer)

    def record_logical_topk_ready(self) -> None:
        """Called by the model after its indexer wrote the buffer; no group to notify."""

    # -- capacities, preparation, scratch ---------------------------------------------
    def _declare_caps(
        self,
        num_heads: int,
        buffer: torch.Tensor | None,
        indexer: object | None,
        dcp: bool = False,
    ) -> SparseMLACaps:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        topk = buffer.shape[-1] if buffer is not None else None
        if topk is None and indexer is not None:
            topk = getattr(getattr(indexer, "topk_indices_buffer", None), "shape", [None])[-1]
        max_tokens, block_size, buckets = 8192, 64, ()
        if config is not None:
            max_tokens = config.scheduler_config.max_num_batched_tokens
            block_size = config.cache_config.block_size or 64
            hf = config.model_config.hf_text_config if config.model_config is not None else None
            if topk is None and getattr(hf, "index_topk", None) is not None:
                topk = topk_buffer_width(hf)  # the model's buffer width (kpool: wider)
            sizes = config.compilation_config.cudagraph_capture_sizes or ()
            buckets = tuple(s for s in sizes if s <= max_tokens)
        if topk is None:
            raise ValueError(f"{NAME}: top-k width unknown (no buffer, indexer or index_topk)")
        return SparseMLACaps(
            max_tokens=max_tokens,
            num_heads=num_heads,
            topk=int(topk),
            kv_format=self.kv_format,
            block_size=block_size,
            q_dtype=self.model_dtype,
            return_lse=dcp,  # DCP: vLLM merges the ranks by it
            token_buckets=buckets,
            dcp=dcp,
            sink=self.sinks is not None,  # the kernel's sink variant is the one prepared
            rope=self.qk_rope_head_dim,  # 64, or 0: q_pe [T, H, 0], rope-0 records
        )

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """Plan and prepare before vLLM's profiling capture (nothing compiles in it);
        under DCP gather the group's sinks (every rank runs this, in layer order)."""
        self._gather_dcp_sinks()
        session = self._bind_plan(_device_of(self.kv_b_proj))
        if not session.is_prepared(self.plan, self.caps.max_tokens) and not session.frozen:
            session.prepare(self.plan)

    def _bind_plan(self, device: torch.device) -> PreparationSession:
        self.session = session_for(device)
        chosen = self.session.kernel.select_impl(device)
        impl = serving_impl(
            chosen, self.dcp.size, self.sinks is not None, self.qk_rope_head_dim, self.kv_format
        )
        self.plan = plan_for(device, self.caps, None if impl == chosen else impl)
        self._call = None  # the next forward binds a call to this plan
        self._locked_buffers = None
        self._step_buffers = {}
        return self.session

    def reserve_workspace(self) -> None:
        """Profile run: grow vLLM's shared workspace to this plan's scratch and output
        buffer (upstream's sparse impls reserve a ``[max_tokens, H, 576]`` q buffer there;
        this impl needs none, since it reads the split query in place)."""
        self._scratch()

    def prepare_for_batch(self, attn_metadata: Any) -> None:
        """Called by vLLM 0.33's DSA model (``DeepseekV32Attention``) before its indexer,
        once with None in the profile run, where ``forward_impl`` (and its
        ``reserve_workspace``) never runs: reserve the scratch there, before the KV cache
        is sized. Nothing to prepare per batch: selection is resolved in forward."""
        if attn_metadata is None:
            self.reserve_workspace()

    def do_kv_cache_update(
        self,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        """Write this step's latents into the cache records (slots < 0 skipped).

        bf16 and fp8_ds_mla on CUDA: vLLM's own ``concat_and_cache_mla`` (the base
        implementation). nvfp4_ds_mla on CUDA: this project's Triton writer (vLLM writes
        it only with SM100 PTX). Elsewhere (vLLM CPU has no such op): the torch
        reference, every format. ``k_scale`` is not read: no format here has a
        per-tensor scale.
        """
        if kv_cache.is_cuda and self.kv_format not in TRITON_WRITERS:
            base = super().do_kv_cache_update
            args = (kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
            return base(*args, skip_scale) if skip_scale else base(*args)
        write_records(kv_c_normed, k_pe, kv_cache, slot_mapping, self.kv_format)
        telemetry.record_sparse(f"kv_write:{self.kv_format}")

    def _workspace(self) -> StepBuffers | None:
        """(scratch, out buffer [max_tokens, H, 512], lse buffer [max_tokens, H] fp32 under
        DCP else None) from vLLM's shared workspace, or None without one (then the call
        allocates its output). Once vLLM locks the workspace (after capture) the views
        are kept: it no longer moves."""
        if self._locked_buffers is not None:
            return self._locked_buffers
        from vllm.v1.worker.workspace import (
            current_workspace_manager,
            is_workspace_manager_initialized,
        )

        if self.plan is None or self.session is None or not is_workspace_manager_initialized():
            return None
        manager = current_workspace_manager()
        locked = manager.is_locked()
        if locked and not self.session.frozen:
            self.session.freeze()  # vLLM locks its workspace after capture: compiling is over
        caps = self.caps
        specs = [
            ((max(self.plan.scratch_bytes, 16),), torch.uint8),
            ((caps.max_tokens, caps.num_heads, LATENT), caps.q_dtype),
        ]
        if caps.return_lse:
            specs.append(((caps.max_tokens, caps.num_heads), torch.float32))
        views = manager.get_simultaneous(*specs)
        buffers = (views[0], views[1], views[2] if caps.return_lse else None)
        if locked:
            self._locked_buffers = buffers
        return buffers

    def _scratch(self) -> torch.Tensor | None:
        buffers = self._workspace()
        return None if buffers is None else buffers[0]

    def _step(self, num_tokens: int) -> StepBuffers:
        """(scratch, out [T, H, 512], lse [T, H] under DCP) for ``num_tokens`` tokens."""
        hit = self._step_buffers.get(num_tokens)  # filled once the workspace is locked
        if hit is not None:
            return hit
        buffers = self._workspace()
        if buffers is None:
            return None, None, None
        lse = buffers[2]
        step = (buffers[0], buffers[1][:num_tokens], None if lse is None else lse[:num_tokens])
        if self._locked_buffers is not None:  # locked: the views never move again
            self._step_buffers[num_tokens] = step
        return step

    def _buffers(self, num_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """BoundCall's (scratch, out) for ``num_tokens`` tokens."""
        step = self._step(num_tokens)
        return step[0], step[1]

    def _lse(self, num_tokens: int, like: torch.Tensor) -> torch.Tensor:
        """The DCP lse buffer ``[T, H]`` fp32 (the workspace's; allocated without one)."""
        lse = self._step(num_tokens)[2]
        if lse is None:
            lse = like.new_empty((num_tokens, self.caps.num_heads), dtype=torch.float32)
        return lse

    # -- forward ----------------------------------------------------------------------
    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Any,
        layer: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sparse attention of all tokens: (out [T, H, 512], None), or under DCP (out, lse
        [T, H] fp32 natural log) over the selected tokens this rank holds. With the layer's
        ``sinks`` every call passes them (one more term of each head's denominator).

        Three hops to the launch: here -> ``BoundCall.run`` -> the kernel's launch. The
        output (and the lse) is a view of vLLM's shared workspace (consumed by the DCP
        combine and the V up-projection before any other layer runs), so a step
        allocates nothing. With the Triton plan the kernel maps the logical top-k through
        the block table itself (no conversion kernel, no physical-row buffer; under DCP
        it also drops the positions other ranks hold); b12x and the reference take
        physical rows.
        """
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:  # fused [T, H, 512 + rope]: split as views, no copy (rope 0: q_pe [T, H, 0])
            q_nope, q_pe = q[..., :LATENT], q[..., LATENT:]
        num_tokens = q_nope.shape[0]
        logical = self._selection.resolve(num_tokens)
        call = self._call
        if call is None:
            call = self._bind_call(kv_c_and_k_pe_cache, attn_metadata.block_size)
        telemetry.record_sparse(self._forward_event)
        lse = self._lse(num_tokens, q_nope) if self.caps.return_lse else None
        if call.maps_logical:
            out = call.run(
                q_nope,
                q_pe,
                kv_c_and_k_pe_cache,
                logical,
                attn_metadata.req_id_per_token,
                attn_metadata.block_table,
                lse=lse,
                sink=self._call_sinks,
            )
            return out, lse
        rows = getattr(attn_metadata, "physical_indices", None)  # the builder's buffer
        physical = convert_to_physical(
            attn_metadata.req_id_per_token[:num_tokens],
            attn_metadata.block_table,
            logical,
            attn_metadata.block_size,
            out=None if rows is None else rows[:num_tokens, : logical.shape[1]],
            shard=self.dcp,
        )
        out = call.run(q_nope, q_pe, kv_c_and_k_pe_cache, physical, lse=lse, sink=self._call_sinks)
        return out, lse

    def _gather_dcp_sinks(self) -> None:
        """``_call_sinks`` for the group's heads (``dcp_sinks``), refreshed in place (a
        captured graph keeps reading the same tensor); no sink or no DCP: the sinks."""
        if self.sinks is None or self.dcp.trivial:
            self._call_sinks = self.sinks
            return
        from vllm.distributed import get_dcp_group

        sinks = dcp_sinks(self.sinks, self.dcp.rank, get_dcp_group().all_gather)
        if self._call_sinks is None or self._call_sinks.shape != sinks.shape:
            self._call_sinks = sinks
        else:
            self._call_sinks.copy_(sinks)

    def _bind_call(self, kv_cache: torch.Tensor, block_size: int) -> BoundCall:
        if block_size != kv_cache.shape[1]:
            raise ValueError(
                f"sparse MLA: attn_metadata.block_size {block_size} != the KV cache's block "
                f"size {kv_cache.shape[1]} (kv_cache {tuple(kv_cache.shape)})"
            )
        if self.session is None or self.plan is None:  # post-load did not run (impl alone)
            self._bind_plan(kv_cache.device)
            self._gather_dcp_sinks()
        self._forward_event = f"forward_mqa:{self.plan.impl}"  # type: ignore[union-attr]
        self.dcp = dcp_shard(self.dcp_world_size, self.dcp_rank, self._parallel)  # final now
        if not self.dcp.trivial:
            self._forward_event += f":dcp{self.dcp.rank}/{self.dcp.size}"
        self._call = self.session.bound_call(  # type: ignore[union-attr]
            self.plan, softmax_scale=self.scale, buffers=self._buffers, dcp=self.dcp
        )
        return self._call


def dcp_sinks(sinks: torch.Tensor, dcp_rank: int, all_gather) -> torch.Tensor:
    """fp32 ``[N*H]``: the DCP group's sinks in its gathered head order (``all_gather(x,
    dim=0)``, the order vLLM gathers the query heads in), as DCP rank ``dcp_rank`` passes
    them: rank 0 the sinks, the others -inf. vLLM merges the ranks' partial softmaxes by
    their LSE, so a sink every rank counted would weigh N times; counted on one rank it
    joins the merged denominator exactly once (a -inf sink is no sink)."""
    group = all_gather(sinks.detach().float().contiguous(), dim=0)
    return group if dcp_rank == 0 else torch.full_like(group, float("-inf"))


def convert_to_physical(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    logical: torch.Tensor,
    block_size: int,
    out: torch.Tensor | None = None,
    shard: DCPShard = NO_DCP,
) -> torch.Tensor:
    """Logical top-k -> physical rows ``block * block_size + offset`` (-1 kept), into
    ``out`` when given (no allocation: the metadata builder owns the buffer). Under DCP
    (``shard``) the top-k holds request positions of the group: those another rank holds
    become -1 (``logical_to_physical``, on any device: only the reference plan takes
    physical rows under DCP, b12x declining it)."""
    if logical.is_cuda and shard.trivial:
        return convert_with_vllm(req_id, block_table, logical, block_size, out)
    return logical_to_physical(req_id, block_table, logical, block_size, out=out, shard=shard)


def convert_with_vllm(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    logical: torch.Tensor,
    block_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``convert_to_physical`` on CUDA: vLLM's Triton conversion kernel."""
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    return triton_convert_req_index_to_global_index(
        req_id,
        block_table,
        logical,
        BLOCK_SIZE=block_size,
        NUM_TOPK_TOKENS=logical.shape[1],
        out=out,
    )


def _device_of(module: Any) -> torch.device:
    for param in getattr(module, "parameters", lambda: ())():
        return param.device
    return torch.device("cpu")
