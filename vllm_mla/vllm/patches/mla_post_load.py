"""Patch ``MLAAttention.process_weights_after_loading`` with the lean lifecycle.

Target: ``vllm.model_executor.layers.attention.mla_attention.MLAAttention
.process_weights_after_loading``: ``(self, act_dtype)`` in vLLM 0.32 and 0.33, ``(self)`` in
0.34, which reads the activation dtype from ``self.act_dtype`` (the replacement takes the
installed version's parameters).
Why: upstream keeps kv_b_proj's quantized source and a BF16 absorbed copy, allocated
after dequant scratch (allocator holes), and never releases the source.
How: kv_b_proj's form is looked up in the kv_b_proj matrix (``vllm_mla.weights.forms``:
quant method x selected kernel -> the tensors its post-load left); a known form runs
``vllm_mla.weights.post_load`` (pair allocated first, bounded chunks, release only when
the backend's capability allows it and no dense MHA prefill calls kv_b_proj), or, with
``VLLM_MLA_ABSORBED=direct``, binds MXFP8 views of kv_b_proj's pack instead of a pair
(``vllm_mla.weights.direct``; refused with the reason where it cannot serve); where the
safe BMM is needed (``needs_safe_bmm``) the pair is then bound as routed weights
(``vllm_mla.weights.route``), so every bmm vLLM runs on it takes our op; the rest
of upstream's tail (DCP query copy, default quant scales) runs as upstream does; last,
``vllm_mla.vllm.fused_query.bind`` routes W_UK_T to the fused query projection where
``VLLM_MLA_QUERY`` and the layer allow it (every post-load, reloads included). A
dense kv_b_proj already in the activation dtype that must stay is aliased as upstream
does (no copy, no scratch: nothing to gain). Delegated untouched to the original: AMX
and ROCm aiter BMM layers (they own their weights) and any kv_b_proj form the matrix
does not know (named once per process in the log). Every call is recorded in
``vllm_mla.vllm.telemetry`` (layer name and action, or why delegated).
Removal: when upstream MLA post-load preallocates the pair, bounds dequant scratch and
releases kv_b_proj by backend capability.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import torch
from torch import nn

from vllm_mla import envs
from vllm_mla.vllm import fused_query, telemetry, wake_check
from vllm_mla.vllm.capabilities import capabilities_for, lifecycle_config
from vllm_mla.weights import LifecycleConfig, PostLoadError, forms, post_load
from vllm_mla.weights.absorb import state_of
from vllm_mla.weights.direct import DIRECT_DECODES, DirectModeError
from vllm_mla.weights.route import bind_safe
from vllm_mla.weights.sources import holds_weights, owner_module

logger = logging.getLogger("vllm_mla")
_logged_unknown: set[str] = set()  # unknown kv_b_proj forms already named in the log

OWN_BMM_FLAGS = (
    "is_amx_bmm_enabled",
    "is_aiter_triton_fp4_bmm_enabled",
    "is_aiter_triton_fp8_bmm_enabled",
)


def backend_name(layer: nn.Module) -> str | None:
    """vLLM's name of the layer's attention backend (None when the layer has none)."""
    backend = getattr(layer, "attn_backend", None)
    get_name = getattr(backend, "get_name", None)
    return get_name() if callable(get_name) else None


def needs_safe_bmm(layer: nn.Module, device: torch.device) -> bool:
    """SM12x GPUs, or a backend declaring ``needs_safe_query_bmm``; never AMX/aiter layers.

    ``VLLM_MLA_SAFE_BMM`` overrides the choice for generic layers: ``always`` / ``never``.
    """
    if any(getattr(layer, flag, False) for flag in OWN_BMM_FLAGS):
        return False
    mode = envs.safe_bmm_mode()
    if mode != "auto":
        return mode == "always"
    if capabilities_for(backend_name(layer) or "").needs_safe_query_bmm:
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 12


def absorbed_mode(layer: nn.Module) -> str:
    """``bf16`` or ``direct`` for this layer, from ``VLLM_MLA_ABSORBED``.

    ``auto`` is ``direct`` only for a backend declaring ``prefers_direct_absorbed`` (none
    does until a GPU measurement shows direct at least as fast) on an MXFP8 pack.
    """
    mode = envs.absorbed_mode()
    if mode != "auto":
        return mode
    if not capabilities_for(backend_name(layer) or "").prefers_direct_absorbed:
        return "bf16"
    found, _ = forms.detect(layer.kv_b_proj)
    return "direct" if found is not None and found.decode in DIRECT_DECODES else "bf16"


def layer_config(layer: nn.Module) -> LifecycleConfig:
    """Lifecycle settings from the backend's capabilities and the layer's prefill path."""
    caps = capabilities_for(backend_name(layer) or "")
    config = lifecycle_config(caps, absorbed=absorbed_mode(layer))
    impl = getattr(layer, "impl", None)
    # Dense MHA prefill calls kv_b_proj: it exists unless both impl and layer opt out
    # and the layer really has no prefill backend.
    dense_prefill = getattr(layer, "prefill_backend", object()) is not None or bool(
        getattr(impl, "supports_dense_mha_prefill", True)
        and getattr(layer, "supports_dense_mha_prefill", True)
    )
    if dense_prefill and not config.dense_mha_prefill:
        config = LifecycleConfig(
            release_source=config.release_source,
            dense_mha_prefill=True,
            max_scratch_bytes=config.max_scratch_bytes,
            absorbed=config.absorbed,
        )
    return config


def delegate_reason(layer: nn.Module) -> str | None:
    """Why this layer goes to upstream's post-load untouched (None: the lifecycle owns it).

    AMX and aiter layers own their weights; a kv_b_proj form the matrix does not know is
    never guessed at. A released kv_b_proj (nothing left to detect) stays ours.
    """
    for flag in OWN_BMM_FLAGS:
        if getattr(layer, flag, False):
            if envs.absorbed_mode() == "direct":
                raise DirectModeError(
                    f"VLLM_MLA_ABSORBED=direct: this layer's backend owns its absorbed "
                    f"weights ({flag}: it packs W_UK/W_UV itself), so direct mode cannot "
                    "serve it; select the generic MLA backend or use bf16 mode"
                )
            return flag
    if state_of(layer).direct is not None:
        return None  # direct views bound: ours, even with swizzled scales released
    found, why = forms.detect(layer.kv_b_proj)
    if found is None and holds_weights(owner_module(layer.kv_b_proj), forms.PACKED_ATTRS):
        if why not in _logged_unknown:
            _logged_unknown.add(why)
            logger.warning("vllm-mla: %s; delegated to upstream's post-load untouched", why)
        return why
    return None


def _upstream_tail(layer: nn.Module) -> None:
    """Upstream's steps after the pair exists: DCP query copy, the gathered W_UV of 0.34's
    DCP v-up-projection combine, default quant scales."""
    from vllm.model_executor.layers.attention import mla_attention as mla
    from vllm.model_executor.utils import replace_parameter

    if getattr(layer, "dcp_q_replicate", False):
        gathered = mla.get_dcp_group().all_gather(layer.W_UK_T.contiguous(), dim=0)
        replace_parameter(layer, "W_UK_T_dcp_qrep", gathered)
    manager = getattr(layer, "dcp_manager", None)
    if manager is not None and getattr(manager, "v_up_proj_combine", None) is not None:
        gathered = mla.get_dcp_group().all_gather(layer.W_UV.contiguous(), dim=0)
        replace_parameter(layer, "W_UV_dcp", gathered)
    quant_config = getattr(layer, "quant_config", None)
    method = (
        mla.resolve_quant_method(quant_config, layer, prefix=layer.layer_name)
        if quant_config
        else None
    )
    if not mla.should_load_quant_weights(method):
        mla.set_default_quant_scales(layer, register_buffer=False)


def _bind_route(layer: nn.Module, name: str) -> None:
    """Safe mode: wrap the pair so every bmm on it runs the bounds-safe op."""
    pair = getattr(layer, "W_UK_T", None)
    if isinstance(pair, torch.Tensor) and needs_safe_bmm(layer, pair.device):
        bind_safe(layer)
        telemetry.record_post_load(name, "safe route bound")


def make_process_weights_after_loading(original: Callable) -> Callable:
    """The replacement for ``MLAAttention.process_weights_after_loading``, with the
    original's parameters: ``(self, act_dtype)`` (vLLM 0.32 / 0.33) or ``(self)`` (0.34)."""

    def run(self: nn.Module, act_dtype: torch.dtype, upstream: Callable[[], None]) -> None:
        name = getattr(self, "layer_name", type(self).__name__)
        reason = delegate_reason(self)
        if reason is not None:
            telemetry.record_post_load(name, f"delegated: {reason}")
            result = upstream()
            _bind_route(self, name)
            fused_query.bind(self, name)
            wake_check.STATE.register(self, name)
            return result
        config = layer_config(self)
        self.impl.process_weights_after_loading(act_dtype)
        if getattr(self, "dcp_q_replicate", False):
            pad = getattr(self, "q_pad_num_heads", None)
            if pad not in (None, self.num_heads):
                raise ValueError("DCP query replication is unsupported with q_pad_num_heads")
        # refresh: vLLM's reload writes new weights through .data, which no version
        # counter sees, so a present source is always re-materialized (in place).
        try:
            report = post_load(self, act_dtype, config, refresh=True)
        except PostLoadError as exc:
            exc.layer = name  # the error names the layer it left as it was
            raise
        _upstream_tail(self)
        telemetry.record_post_load(name, report.action)
        if config.absorbed == "bf16":
            _bind_route(self, name)
        fused_query.bind(self, name)  # VLLM_MLA_QUERY: the deferred query bmm and its consumer
        wake_check.STATE.register(self, name)  # after every (re)load: allocates nothing

    if "act_dtype" in inspect.signature(original).parameters:

        def process_weights_after_loading(self: nn.Module, act_dtype: torch.dtype) -> None:
            return run(self, act_dtype, lambda: original(self, act_dtype))

    else:  # vLLM 0.34: the layer holds its activation dtype

        def process_weights_after_loading(self: nn.Module) -> None:
            return run(self, self.act_dtype, lambda: original(self))

    process_weights_after_loading.__doc__ = original.__doc__
    process_weights_after_loading.__qualname__ = original.__qualname__
    return process_weights_after_loading
