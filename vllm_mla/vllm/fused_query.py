"""Feature ``query`` (``VLLM_MLA_QUERY``): the fused query projection on vLLM's decode path.

What vLLM 0.32/0.33 run per MLA decode layer-step (``MLAAttention.forward_impl``; in 0.34 the
same steps sit in ``MLAAttention._prepare_mqa_query``, which ``forward_impl`` calls): the W_UK_T
bmm into a ``[M, H, L]`` buffer it allocates, then either ``_decode_concat_quant_fp8_op``
(an FP8 KV cache and an impl that takes an FP8 query, ``supports_quant_query_input``:
FlashMLA, FlashInfer MLA; cat + per-tensor quant) or the tuple ``(ql_nope, q_pe)`` to
``impl.forward_mqa``, whose first line concatenates (FlashMLA, FlashInfer MLA, Triton MLA,
CPU MLA, B12X_MLA_SPARSE). Here both become one ``mla_query_projection``
(``vllm_mla.ops.query_fusion``): the routed W_UK_T's bmm is deferred and the consumer writes
the final ``[M, H, L + R]`` query once.

Target (no class attribute of vLLM is replaced):

- ``vllm.model_executor.layers.attention.mla_attention._DecodeConcatQuantFP8``, through
  vLLM's own ``CustomOp.register_oot``: every MLA layer builds
  ``FusedDecodeConcatQuantFP8``, whose ``forward`` (not ``forward_native``, which vLLM may
  compile) takes a pending bmm and otherwise runs vLLM's dispatch (``_forward_method``:
  ``forward_cuda``, or the compiled ``forward_native``) unchanged. Its registry name stays
  ``mla_decode_concat_quant_fp8``, so ``custom_ops`` settings read as before.
- per eligible layer, two instance attributes, set at post-load and again at every reload:
  ``layer.forward_impl`` (arms the layer's deferral for exactly that call, then vLLM's
  method) and ``layer.impl.forward_mqa`` (tuple path: the backend gets one query tensor
  where it would concatenate, then the impl's own method runs). The impls' ``forward_mqa``
  take a tensor as well as the tuple (``tests_vllm/test_fused_query.py`` reads it from each
  one's source).

Why: the bmm, the concat and the quant are separate calls in vLLM's forward code, and the
routed bmm sees only its own call; fusing them needs the consumer's hand.

How (``bind``, from the post-load patch): a layer is eligible (``plan``) when the feature
is on and ``VLLM_MLA_QUERY`` is not ``staged``; it runs vLLM's generic bmm branch (no AMX,
no aiter, ``forward_impl`` not traced: ``use_direct_call`` off); DCP 1 and no PCP (the
tuple would be concatenated and gathered before any consumer); no ShardQ (vLLM 0.34's
``shard_q`` slices the query before ``forward_mqa``); no padded heads; and its
consumer is ours (the FP8 op above is the layer's, or the impl is one whose ``forward_mqa``
is wrapped). ``auto`` adds: on CUDA, BF16, and ``can_fuse_query_projection`` true for the
layer's shape at M = 64. Then W_UK_T is routed (a plain one is wrapped with upstream's
``torch.bmm`` path, same storage), a ``QueryFusion`` is attached and the kernel variants are
compiled for every graph-visible M (``prewarm_query_projection``: the CUDA-graph capture
sizes up to 64, on CUDA only) before vLLM captures anything.

DSA on CUDA (``DeepseekV32Attention``, which calls ``impl.forward_mqa`` itself with
``(ql_nope, q_pe)``, the bmm compiled without ``out``): where the backend declares
``supports_fused_query_projection`` (B12X_MLA_SPARSE) and serves the layer with a b12x plan
on an ``fp8_ds_mla`` cache, W_UK_T gets ``row_width = L + R``: the bmm writes the left part
of one ``[M, H, L + R]`` buffer, the wrapped ``forward_mqa`` copies only q_pe beside it
(``query_fusion.row_query``) and b12x reads the buffer in place (it copied both halves).

Removal: when vLLM builds the MLA decode query in one op that plugins can provide.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from vllm_mla import envs
from vllm_mla.formats import ROPE, SPARSE_BACKEND
from vllm_mla.ops import query_fusion
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.ops.query_projection import (
    FUSED_MAX_M,
    can_fuse_query_projection,
    prewarm_query_projection,
)
from vllm_mla.ops.sparse_mla.formats import FORMAT
from vllm_mla.vllm import telemetry
from vllm_mla.vllm.capabilities import capabilities_for

logger = logging.getLogger("vllm_mla")

# Impls whose forward_mqa concatenates a (ql_nope, q_pe) tuple first and takes a tensor too.
FORWARD_MQA_BACKENDS = ("FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "CPU_MLA", SPARSE_BACKEND)
OWN_BMM_FLAGS = (
    "is_amx_bmm_enabled",
    "is_aiter_triton_fp4_bmm_enabled",
    "is_aiter_triton_fp8_bmm_enabled",
)
WRAPPED = "_vllm_mla_fused_query"  # marks our instance wrappers
OP_NAME = "FusedDecodeConcatQuantFP8"
_enabled: str | None = None  # what register() did (None: not registered in this process)
_prewarmed: set[tuple] = set()


@dataclass(frozen=True)
class Plan:
    """What ``bind`` does to a layer: the consumer (None: staged) and why."""

    consumer: str | None  # "concat_quant_fp8" | "forward_mqa" | None
    kernel: bool = False  # the Triton kernel (else the torch path)
    rows: int = 0  # DSA row layout width (0: none)
    why: str = ""


def make_concat_quant(base: type) -> type:
    """vLLM's ``_DecodeConcatQuantFP8`` taking a pending W_UK_T bmm when there is one."""

    class FusedDecodeConcatQuantFP8(base):
        """``_DecodeConcatQuantFP8`` whose call first offers the query to the deferred
        projection (``query_fusion.project_fp8``); vLLM's own path otherwise."""

        def forward(self, decode_ql_nope, decode_q_pe, scale, scale_ub=None):
            q = query_fusion.project_fp8(decode_ql_nope, decode_q_pe, scale, scale_ub)
            if q is not None:
                return q
            return self._forward_method(decode_ql_nope, decode_q_pe, scale, scale_ub)

    FusedDecodeConcatQuantFP8.__qualname__ = OP_NAME
    return FusedDecodeConcatQuantFP8


def _mla_module():
    from vllm.model_executor.layers.attention import mla_attention

    return mla_attention


def register() -> str:
    """Enable the fused query projection in this process (once); what happened, for the log.

    ``VLLM_MLA_QUERY=staged`` registers nothing (vLLM untouched). The FP8 consumer goes in
    through ``_DecodeConcatQuantFP8.register_oot`` unless another plugin holds that slot
    (then only the tuple path is fused).
    """
    global _enabled
    if envs.query_mode() == "staged":
        return "fused query projection off (VLLM_MLA_QUERY=staged)"
    if _enabled is not None:
        return _enabled
    from vllm.model_executor.custom_op import op_registry_oot

    base = _mla_module()._DecodeConcatQuantFP8
    owner = op_registry_oot.get(base.__name__)
    if owner is not None and owner.__qualname__ != OP_NAME:
        _enabled = (
            f"fused query projection (FP8 concat+quant left to {owner.__module__}."
            f"{owner.__qualname__}; BF16 forward_mqa path)"
        )
        return _enabled
    if owner is None:
        name = base.name
        cls = make_concat_quant(base)
        base.register_oot(cls)
        cls.name = name  # register_oot renames it; vLLM's custom_ops settings use this one
    _enabled = (
        "fused query projection (_DecodeConcatQuantFP8.register_oot, forward_mqa wrap; "
        f"VLLM_MLA_QUERY={envs.query_mode()})"
    )
    return _enabled


def unregister() -> None:
    """Forget the registration (tests); layers built meanwhile keep their op."""
    global _enabled
    _enabled = None
    try:
        from vllm.model_executor.custom_op import op_registry_oot
    except ImportError:
        return
    owner = op_registry_oot.get("_DecodeConcatQuantFP8")
    if owner is not None and owner.__qualname__ == OP_NAME:
        del op_registry_oot["_DecodeConcatQuantFP8"]


def enabled() -> bool:
    return _enabled is not None


def _backend_name(layer: nn.Module) -> str:
    get_name = getattr(getattr(layer, "attn_backend", None), "get_name", None)
    return get_name() if callable(get_name) else ""


def _fp8_query(layer: nn.Module) -> bool:
    """vLLM's own condition for ``_decode_concat_quant_fp8_op`` in ``forward_impl``."""
    dtype = getattr(layer, "kv_cache_dtype", "auto")
    quantized = _mla_module().is_quantized_kv_cache(dtype)
    return bool(quantized and getattr(layer.impl, "supports_quant_query_input", False))


def _weight_format(weight: torch.Tensor) -> str:
    return "mxfp8" if isinstance(weight, AbsorbedWeight) and weight.kind == "mxfp8" else "bf16"


def _kernel_ok(layer: nn.Module, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """The Triton kernel can serve this layer at every M up to 64."""
    inner = weight.inner_tensors() if isinstance(weight, AbsorbedWeight) else [weight]
    if weight.dtype != torch.bfloat16 or any(t.stride(-1) != 1 for t in inner):
        return False
    return layer.qk_rope_head_dim == ROPE and can_fuse_query_projection(
        num_heads=weight.shape[0],
        max_m=FUSED_MAX_M,
        nope_dim=weight.shape[1],
        latent_dim=weight.shape[2],
        out_dtype=out_dtype,
        weight_format=_weight_format(weight),
        device=weight.device,
    )


def _rows(layer: nn.Module, mode: str) -> int:
    """The DSA row layout's width for this layer (0: none): a backend declaring
    ``supports_fused_query_projection`` that serves it with a b12x plan on a record b12x
    reads (the KV-format table's ``b12x_recipe``: fp8_ds_mla)."""
    caps = capabilities_for(_backend_name(layer))
    if mode == "staged" or not caps.supports_fused_query_projection:
        return 0
    impl = layer.impl
    plan = getattr(impl, "plan", None)
    fmt = FORMAT.get(getattr(impl, "kv_format", None) or "")
    if getattr(plan, "impl", None) != "b12x" or fmt is None or fmt.b12x_recipe is None:
        return 0
    if layer.qk_rope_head_dim != ROPE:  # b12x reads [latent | rope] rows of this geometry
        return 0
    return int(layer.kv_lora_rank) + int(layer.qk_rope_head_dim)


def plan(layer: nn.Module) -> Plan:
    """Whether and how ``layer``'s decode query is fused (module docstring: the gate)."""
    mode = envs.query_mode()
    if mode == "staged":
        return Plan(None, why="VLLM_MLA_QUERY=staged")
    if _enabled is None:
        return Plan(None, why="feature query not registered in this process")
    for flag in OWN_BMM_FLAGS:
        if getattr(layer, flag, False):
            return Plan(None, why=f"{flag}: the layer runs its own bmm")
    weight = getattr(layer, "W_UK_T", None)
    impl = getattr(layer, "impl", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or impl is None:
        return Plan(None, why="no absorbed W_UK_T")
    rows = _rows(layer, mode)
    if getattr(layer, "use_direct_call", False):
        return Plan(None, rows=rows, why="forward_impl is traced (not an opaque op)")
    if getattr(impl, "dcp_world_size", 1) > 1 or getattr(layer, "use_pcp", False):
        return Plan(None, rows=rows, why="DCP/PCP concatenates and gathers the query first")
    if getattr(layer, "use_shardq", False):
        return Plan(None, rows=rows, why="ShardQ slices the query before forward_mqa (vLLM 0.34)")
    if getattr(layer, "q_pad_num_heads", None) is not None:
        return Plan(None, rows=rows, why="padded query heads")
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return Plan(None, rows=rows, why=f"activation dtype {weight.dtype}")
    if _fp8_query(layer):
        op = getattr(layer, "_decode_concat_quant_fp8_op", None)
        if getattr(type(op), "__qualname__", "") != OP_NAME:
            return Plan(None, rows=rows, why="the FP8 concat+quant op is not ours")
        from vllm.platforms import current_platform

        if current_platform.fp8_dtype() != torch.float8_e4m3fn:
            return Plan(None, rows=rows, why="the platform's FP8 is not e4m3fn")
        consumer, out_dtype = "concat_quant_fp8", torch.float8_e4m3fn
    elif _backend_name(layer) in FORWARD_MQA_BACKENDS:
        consumer, out_dtype = "forward_mqa", weight.dtype
    else:
        return Plan(None, rows=rows, why=f"backend {_backend_name(layer)!r}: no consumer of ours")
    kernel = _kernel_ok(layer, weight, out_dtype)
    if mode == "auto" and not (kernel and weight.device.type == "cuda"):
        return Plan(None, rows=rows, why="auto: the fused kernel does not serve this layer")
    return Plan(consumer, kernel=kernel, rows=rows, why=mode)


def _routed_w_uk_t(layer: nn.Module, rows: int) -> AbsorbedWeight:
    """The layer's W_UK_T as a routed parameter (same storage) with ``rows``."""
    current = layer._parameters.get("W_UK_T")
    if current is None:
        current = layer.W_UK_T
    if isinstance(current, AbsorbedWeight):
        if current.row_width == rows:
            return current
        weight = current.rebound(row_width=rows)
    else:
        weight = AbsorbedWeight.dense(current.detach(), "W_UK_T", path="torch", row_width=rows)
    layer.__dict__.pop("W_UK_T", None)
    layer._buffers.pop("W_UK_T", None)
    param = nn.Parameter(weight, requires_grad=False)
    layer._parameters["W_UK_T"] = param
    return param


def _armed(original, fusion: query_fusion.QueryFusion):
    arm, disarm = query_fusion.arm, query_fusion.disarm

    def forward_impl(*args, **kwargs):
        arm(fusion)
        try:
            return original(*args, **kwargs)
        finally:
            disarm()

    forward_impl.__wrapped__ = original
    setattr(forward_impl, WRAPPED, True)
    return forward_impl


def _consumer(original, rows: int):
    project, row_query = query_fusion.project_bf16, query_fusion.row_query

    def forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer):
        if type(q) is tuple:
            fused = project(q[0], q[1])
            if fused is None and rows and q[0].shape[-1] + q[1].shape[-1] == rows:
                fused = row_query(q[0], q[1])
            if fused is not None:
                q = fused
        return original(q, kv_c_and_k_pe_cache, attn_metadata, layer)

    forward_mqa.__wrapped__ = original
    setattr(forward_mqa, WRAPPED, True)
    return forward_mqa


def _unwrap(owner: object, attr: str) -> None:
    current = owner.__dict__.get(attr)
    if current is None or not getattr(current, WRAPPED, False):
        return
    if hasattr(type(owner), attr):
        del owner.__dict__[attr]  # the class's method shows again
    else:  # the wrapped callable was the instance's own attribute: put it back
        owner.__dict__[attr] = current.__wrapped__


def unbind(layer: nn.Module) -> None:
    """Undo ``bind``'s wrappers and fusion (the routed weight stays, same values)."""
    _unwrap(layer, "forward_impl")
    impl = getattr(layer, "impl", None)
    if impl is not None and hasattr(impl, "__dict__"):
        _unwrap(impl, "forward_mqa")
    weight = layer._parameters.get("W_UK_T")
    if isinstance(weight, AbsorbedWeight):
        weight.attach_fusion(None)


def graph_sizes(max_m: int = FUSED_MAX_M) -> list[int]:
    """The CUDA-graph capture sizes up to ``max_m`` of the current vLLM config (none when
    vLLM captures no graph)."""
    try:
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config().compilation_config
    except Exception:  # no vLLM config here: nothing is captured
        return []
    mode = getattr(config, "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", "") == "NONE":
        return []
    return sorted({int(s) for s in (config.cudagraph_capture_sizes or []) if 0 < s <= max_m})


def _prewarm(fusion: query_fusion.QueryFusion, out_dtype: torch.dtype) -> None:
    """Compile every kernel variant a captured M can take, once per process and shape."""
    device = fusion.weight.device
    if device.type != "cuda" or not fusion.kernel:
        return  # CPU: nothing is captured, nothing to compile ahead
    sizes = graph_sizes(fusion.max_m)
    fmt = _weight_format(fusion.weight)
    key = (device, fusion.heads, fusion.nope, fmt, out_dtype, tuple(sizes))
    if not sizes or key in _prewarmed:
        return
    prewarm_query_projection(
        sizes,
        num_heads=fusion.heads,
        nope_dim=fusion.nope,
        weight_format=fmt,
        out_dtype=out_dtype,
        device=device,
    )
    _prewarmed.add(key)


def bind(layer: nn.Module, name: str = "") -> Plan:
    """Apply ``plan(layer)`` (after every post-load); returns it."""
    decided = plan(layer)
    unbind(layer)
    if decided.consumer is None and not decided.rows:
        return decided
    weight = _routed_w_uk_t(layer, decided.rows)
    impl = layer.impl
    if decided.consumer is not None:
        fusion = query_fusion.QueryFusion(
            weight,
            rope=layer.qk_rope_head_dim,
            max_m=FUSED_MAX_M,
            kernel=decided.kernel,
        )
        weight.attach_fusion(fusion)
        layer.__dict__["forward_impl"] = _armed(layer.forward_impl, fusion)
        fp8 = decided.consumer == "concat_quant_fp8"
        _prewarm(fusion, torch.float8_e4m3fn if fp8 else weight.dtype)
        telemetry.record_query(f"bind:{decided.consumer}:{fusion.path}")
    if decided.consumer == "forward_mqa" or decided.rows:
        impl.__dict__["forward_mqa"] = _consumer(impl.forward_mqa, decided.rows)
    if decided.rows:
        telemetry.record_query("bind:rows")
    logger.debug("vllm-mla: fused query on %s: %s", name or type(layer).__name__, decided)
    return decided


__all__ = [
    "FORWARD_MQA_BACKENDS",
    "Plan",
    "bind",
    "enabled",
    "graph_sizes",
    "make_concat_quant",
    "plan",
    "register",
    "unbind",
    "unregister",
]
