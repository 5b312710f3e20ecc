"""A model of upstream vLLM 0.33's MLA post-load, for side-by-side measurement
(``baseline_post_load``), and the views upstream binds (``upstream_views``), which the
lifecycle reuses where a dense source already in the serving dtype must stay."""

from __future__ import annotations

import torch
from torch import nn

from vllm_mla.formats import FP8_BLOCK
from vllm_mla.quant import mxfp8
from vllm_mla.weights import forms
from vllm_mla.weights.lifecycle import (
    LifecycleConfig,
    LifecycleError,
    bind_parameter,
    default_reader,
    layer_dims,
)
from vllm_mla.weights.sources import KVBSource


def baseline_post_load(layer: nn.Module, act_dtype: torch.dtype = torch.bfloat16) -> None:
    """What vLLM 0.33's MLA post-load does for kv_b_proj's form (``KVBForm.upstream``).

    ``cast``: ``weight.to(act_dtype)`` (the pair aliases a weight already in that dtype).
    ``scaled-dequantize``: the whole layer through float32 temporaries, then cast.
    ``apply-eye``: a ``[K, K]`` identity in the activation dtype (quantized first by a W8A8
    kernel: e4m3 values and scales) through the layer's GEMM into a ``[K, N]`` output that
    the pair keeps as views. The GEMM itself is modelled: exact values written one head at
    a time (<= one head of float32 decode scratch, a modelling artefact; upstream's output
    is the exact dequantization for every kernel of the matrix). The source is kept.
    """
    source = default_reader(act_dtype)(layer.kv_b_proj)
    if source is None:
        raise LifecycleError("baseline post-load needs kv_b_proj's source tensors")
    f = forms.form(source.form)
    if f.upstream == "cast":
        weight = source.dense.to(act_dtype)
    elif f.upstream == "scaled-dequantize":
        weight = _scaled_dequantize(source).to(act_dtype)
    else:
        weight = _apply_identity(layer, source, f, act_dtype).T
    for name, view in upstream_views(layer, weight).items():
        _replace_parameter(layer, name, view)


def aliases_source(source: KVBSource, act_dtype: torch.dtype, config: LifecycleConfig) -> bool:
    """True when the pair is best left as views of the source: a dense kv_b_proj already
    in ``act_dtype`` that must stay. A copy would add the pair's bytes and save nothing."""
    return (
        source.dense is not None
        and forms.form(source.form).family == "unquantized"
        and source.dense.dtype == act_dtype
        and not config.release_source
    )


def upstream_views(layer: nn.Module, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's pair as views of ``weight [N*(P+V), L]``: W_UK_T [N, P, L], W_UV [N, L, V]."""
    n, p, v, lat = layer_dims(layer)
    w_uk, w_uv = weight.T.view(lat, n, p + v).split([p, v], dim=-1)
    return {"W_UV": w_uv.transpose(0, 1), "W_UK_T": w_uk.permute(1, 2, 0)}


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _scaled_dequantize(source: KVBSource) -> torch.Tensor:
    """Block FP8 as vLLM's ``scaled_dequantize``: widen the values and the broadcast
    scales to float32 ``[N, K]`` and multiply, whole layer at once. Same float32 products
    as the chunked readers, so the values are bit-identical."""
    weight, scale = (source.module._parameters[n] for n in ("weight", "weight_scale_inv"))
    rows, cols = source.shape
    grid = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.to(torch.float32) * grid[:rows, :cols]


# Element bytes of the activation scales a W8A8 kernel makes for the identity, per
# element of the identity: block FP8 one fp32 per 128, MXFP8 one E8M0 byte per 32.
_ACT_SCALE_BYTES = {"fp8-block": 4 / 128, "mxfp8": 1 / mxfp8.BLOCK_SIZE}


def _apply_identity(
    layer: nn.Module, source: KVBSource, f: forms.KVBForm, act_dtype: torch.dtype
) -> torch.Tensor:
    """Upstream's ``quant_method.apply(layer, eye)`` -> ``[K, N]`` in ``act_dtype``."""
    rows, cols = source.shape
    quantized = None
    if f.w8a8:  # the kernel quantizes the identity before its GEMM
        scale_bytes = int(cols * cols * _ACT_SCALE_BYTES[f.family])
        quantized = (
            torch.empty(cols, cols, dtype=torch.float8_e4m3fn, device=source.device),
            torch.empty(scale_bytes, dtype=torch.uint8, device=source.device),
        )
    if source.reader.axis == "cols":  # the layer's own GEMM reads its layout
        return source.reader.read(0, cols)
    eye = torch.eye(cols, dtype=act_dtype, device=source.device)
    out = torch.empty(cols, rows, dtype=act_dtype, device=eye.device)
    step = layer.qk_nope_head_dim + layer.v_head_dim
    for r in range(0, rows, step):
        out[:, r : r + step].copy_(source.reader.read(r, min(r + step, rows)).T)
    del eye, quantized
    return out


def _replace_parameter(layer: nn.Module, name: str, new: torch.Tensor) -> None:
    old = getattr(layer, name, None)
    if isinstance(old, torch.Tensor) and _same_view(old, new):
        return  # already this very view: copying it onto itself would only cost time
    if (
        isinstance(old, torch.Tensor)
        and old.shape == new.shape
        and old.stride() == new.stride()
        and old.dtype == new.dtype
        and old.device == new.device
    ):
        old.copy_(new)
        return
    bind_parameter(layer, name, nn.Parameter(new, requires_grad=False))
