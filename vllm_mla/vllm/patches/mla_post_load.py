"""Patch ``MLAAttention.process_weights_after_loading`` with the lean lifecycle.

Target: ``vllm.model_executor.layers.attention.mla_attention.MLAAttention
.process_weights_after_loading(self, act_dtype)`` (vLLM 0.32, 0.33).
Why: upstream keeps kv_b_proj's quantized source and a BF16 absorbed copy, allocated
after dequant scratch (allocator holes), and never releases the source.
How: kv_b_proj's form is looked up in the kv_b_proj matrix (``vllm_mla.weights.forms``:
quant method x selected kernel -> the tensors its post-load left); a known form runs
``vllm_mla.weights.post_load`` (pair allocated first, bounded chunks, release only when
the backend's capability allows it and no dense MHA prefill calls kv_b_proj); the rest
of upstream's tail (DCP query copy, default quant scales) runs as upstream does. A
dense kv_b_proj already in the activation dtype that must stay is aliased as upstream
does (no copy, no scratch: nothing to gain). Delegated untouched to the original: AMX
and ROCm aiter BMM layers (they own their weights) and any kv_b_proj form the matrix
does not know (named once per process in the log). Every call is recorded in
``vllm_mla.vllm.telemetry`` (layer name and action, or why delegated).
Removal: when upstream adopts the same allocation order and capability-gated release.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from vllm_mla.backends import capabilities_for, lifecycle_config
from vllm_mla.vllm import telemetry
from vllm_mla.weights import LifecycleConfig, forms, post_load
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


def layer_config(layer: nn.Module) -> LifecycleConfig:
    """Lifecycle settings from the backend's capabilities and the layer's prefill path."""
    caps = capabilities_for(backend_name(layer) or "")
    config = lifecycle_config(caps)
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
        )
    return config


def delegate_reason(layer: nn.Module) -> str | None:
    """Why this layer goes to upstream's post-load untouched (None: the lifecycle owns it).

    AMX and aiter layers own their weights; a kv_b_proj form the matrix does not know is
    never guessed at. A released kv_b_proj (nothing left to detect) stays ours.
    """
    for flag in OWN_BMM_FLAGS:
        if getattr(layer, flag, False):
            return flag
    found, why = forms.detect(layer.kv_b_proj)
    if found is None and holds_weights(owner_module(layer.kv_b_proj), forms.PACKED_ATTRS):
        if why not in _logged_unknown:
            _logged_unknown.add(why)
            logger.warning("vllm-mla: %s; delegated to upstream's post-load untouched", why)
        return why
    return None


def _upstream_tail(layer: nn.Module) -> None:
    """Upstream's steps after the pair exists: DCP query copy, default quant scales."""
    from vllm.model_executor.layers.attention import mla_attention as mla
    from vllm.model_executor.utils import replace_parameter

    if getattr(layer, "dcp_q_replicate", False):
        gathered = mla.get_dcp_group().all_gather(layer.W_UK_T.contiguous(), dim=0)
        replace_parameter(layer, "W_UK_T_dcp_qrep", gathered)
    quant_config = getattr(layer, "quant_config", None)
    method = (
        mla.resolve_quant_method(quant_config, layer, prefix=layer.layer_name)
        if quant_config
        else None
    )
    if not mla.should_load_quant_weights(method):
        mla.set_default_quant_scales(layer, register_buffer=False)


def make_process_weights_after_loading(original: Callable) -> Callable:
    """The replacement for ``MLAAttention.process_weights_after_loading``."""

    def process_weights_after_loading(self: nn.Module, act_dtype: torch.dtype) -> None:
        name = getattr(self, "layer_name", type(self).__name__)
        reason = delegate_reason(self)
        if reason is not None:
            telemetry.record_post_load(name, f"delegated: {reason}")
            return original(self, act_dtype)
        config = layer_config(self)
        self.impl.process_weights_after_loading(act_dtype)
        if getattr(self, "dcp_q_replicate", False):
            pad = getattr(self, "q_pad_num_heads", None)
            if pad not in (None, self.num_heads):
                raise ValueError("DCP query replication is unsupported with q_pad_num_heads")
        # refresh: vLLM's reload writes new weights through .data, which no version
        # counter sees, so a present source is always re-materialized (in place).
        report = post_load(self, act_dtype, config, refresh=True)
        _upstream_tail(self)
        telemetry.record_post_load(name, report.action)

    process_weights_after_loading.__doc__ = original.__doc__
    process_weights_after_loading.__qualname__ = original.__qualname__
    return process_weights_after_loading
