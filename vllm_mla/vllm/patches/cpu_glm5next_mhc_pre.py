"""Patch GLM-5.3-Flash's mHC pre block on CPU so the layer's input RMSNorm is applied.

Target: ``vllm.models.glm5next.common.model.Glm5NextDecoderLayer.hc_pre(self, x, hc_fn,
hc_scale, hc_base, norm_weight, norm_eps)`` (vLLM 0.32, 0.33, 0.34), feature
``sparse-cpu``, CPU platform only, applied when that module is imported.
Why: the decoder layer hands its input RMSNorm to the mHC op (``norm_weight``,
``norm_eps``), and only the CUDA paths apply it: ``MHCPreOp.forward_cpu`` (the ``_C``
library's ``hc_pre_fused_cpu``, absent from ``_C_AVX2`` / ``_C_AVX512``) and
``forward_native`` both return the collapsed streams unnormalized, so every mHC layer of
a GLM-5.3-Flash checkpoint reads an un-normed input on vLLM CPU (another model), and an
AVX2 host has no pre op at all.
How: for CPU tensors the original runs with the layer's pre op answered by its torch
``forward_native`` (vLLM's ``mhc_pre_torch``: any host), then vLLM's own
``_apply_mhc_norm`` applies the weight to the layer input, as the CUDA ops do (telemetry
``mhc:pre:cpu``); everything else to the original.
Removal: when vLLM's CPU mHC ops apply ``norm_weight``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from vllm_mla.vllm import telemetry


class _Native(nn.Module):
    """Answers calls with ``op.forward_native`` (the torch path every host has)."""

    def __init__(self, op: nn.Module) -> None:
        super().__init__()
        self.op = op

    def forward(self, *args, **kwargs):
        return self.op.forward_native(*args, **kwargs)


_NATIVE = "_vllm_mla_native"  # the op's one _Native, made at its first call


@contextlib.contextmanager
def native_op(layer: nn.Module, name: str) -> Iterator[None]:
    """``layer.<name>`` (an mHC CustomOp) answered by its ``forward_native`` for the block."""
    op = getattr(layer, name)
    native = op.__dict__.get(_NATIVE)
    if native is None:
        native = _Native(op)
        object.__setattr__(op, _NATIVE, native)  # not a submodule: no cycle in modules()
    setattr(layer, name, native)
    try:
        yield
    finally:
        setattr(layer, name, op)


def normed(layer_input: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """vLLM's ``_apply_mhc_norm`` (its RMSNorm op; the input as is without a weight)."""
    from vllm.model_executor.layers.mhc import _apply_mhc_norm

    return _apply_mhc_norm(layer_input, weight, eps)


def make_hc_pre(original: Callable) -> Callable:
    """The replacement for ``Glm5NextDecoderLayer.hc_pre``."""

    def hc_pre(self, x, hc_fn, hc_scale, hc_base, norm_weight=None, norm_eps=0.0):
        if x.device.type != "cpu":
            return original(self, x, hc_fn, hc_scale, hc_base, norm_weight, norm_eps)
        telemetry.record_sparse("mhc:pre:cpu")
        with native_op(self, "mhc_pre_op"):
            post, comb, layer_input = original(
                self, x, hc_fn, hc_scale, hc_base, norm_weight, norm_eps
            )
        return post, comb, normed(layer_input, norm_weight, norm_eps)

    return hc_pre
