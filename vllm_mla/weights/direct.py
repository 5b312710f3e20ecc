"""Direct mode: W_UK_T / W_UV as MXFP8 views of kv_b_proj's pack; no BF16 pair exists.

For an MXFP8 kv_b_proj (``[N * (P + V), L]`` e4m3 rows, one E8M0 code per 32 columns)
the absorbed weights are views of the pack itself: head ``h``'s rows ``[0, P)`` are
W_UK_T ``[P, L]`` and rows ``[P, P + V)`` read transposed are W_UV ``[L, V]``; the scales
view the same way (``[H, P, L/32]`` and ``[H, L/32, V]``). MXFP8 values are exact in
BF16 (and fp32), so the model computes the same function as with the BF16 pair.

Forms served (``DIRECT_DECODES``): plain rows (``mxfp8``), the b12x packed owner's rows
(``mxfp8-b12x``), and 128x4-swizzled scales (``mxfp8-swizzled``: FlashInfer CUTLASS and
CuTe-DSL), whose scales are unswizzled once into a plain copy owned by the absorbed
weights (1/32 of the values); the swizzled original is released when the backend never
calls kv_b_proj. Nothing else is released: the pack is the source.

Reload: the views keep pointing at the same storage. When the new weights arrive in
that storage (vLLM's layerwise reload copies into the original kernel tensors) nothing
moves; when they arrive in new tensors they are copied into the live ones and
kv_b_proj is pointed back at them, so addresses never change (CUDA graphs). Swizzled
scales are unswizzled again into the same copy. A failure before the commit changes
nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from vllm_mla.ops.absorbed_matmul import MXFP8_ACT_DTYPES
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.ops.base import MXFP8Weight
from vllm_mla.quant import layouts, mxfp8
from vllm_mla.weights import faults, forms, readers
from vllm_mla.weights.lifecycle import PostLoadError, layer_dims, state_of
from vllm_mla.weights.sources import holds_weights, owner_module, owner_tensors, prepare_release

DIRECT_DECODES = ("mxfp8", "mxfp8-swizzled", "mxfp8-b12x")
PAIR = ("W_UK_T", "W_UV")


class DirectModeError(RuntimeError):
    """Direct mode cannot serve this layer; the message says why and what to change."""


@dataclass
class DirectState:
    """The live pack tensors the views read (their storage never changes)."""

    form: str
    values: torch.Tensor  # [rows, >= L] e4m3 row view of the pack
    scales: torch.Tensor  # [rows, >= L/32] uint8 row view (ours for swizzled forms)
    owns_scales: bool


def check_layer(layer: nn.Module, act_dtype: torch.dtype) -> None:
    """Raise DirectModeError for a layer whose other readers need a dense pair."""
    if act_dtype not in MXFP8_ACT_DTYPES:
        raise DirectModeError(
            f"VLLM_MLA_ABSORBED=direct: activation dtype {act_dtype} is not one of "
            f"{MXFP8_ACT_DTYPES} (MXFP8 values are exact in those); use bf16 mode"
        )
    if getattr(layer, "dcp_q_replicate", False):
        raise DirectModeError(
            "VLLM_MLA_ABSORBED=direct: DCP query replication all-gathers a dense W_UK_T "
            "(W_UK_T_dcp_qrep), which would rebuild a BF16 copy; use bf16 mode with DCP"
        )


def form_of(kv_b_proj: nn.Module) -> forms.KVBForm:
    """kv_b_proj's row of the matrix if direct mode can serve it, else DirectModeError."""
    f, why = forms.detect(kv_b_proj)
    if f is None:
        raise DirectModeError(f"VLLM_MLA_ABSORBED=direct: {why}")
    if f.decode not in DIRECT_DECODES:
        hint = (
            " (set VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=0 to keep the MXFP8 values)"
            if f.name == "mxfp8-emulation"
            else ""
        )
        raise DirectModeError(
            f"VLLM_MLA_ABSORBED=direct needs an MXFP8 pack on kv_b_proj; this one is form "
            f"{f.name!r}{hint}; use VLLM_MLA_ABSORBED=bf16 (or auto)"
        )
    return f


def _rows(module: nn.Module) -> tuple[int, int]:
    rows, cols = forms._dims(module)
    return rows, cols


def pack_tensors(
    f: forms.KVBForm, module: nn.Module
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(values rows, plain scale rows or None, swizzled flat scales or None) as held now."""
    rows, _ = _rows(module)
    tensors = forms.module_tensors(module)
    if f.decode == "mxfp8-b12x":
        packed = getattr(module, forms.B12X_PACKED).weight
        return packed.values, packed.scale_rows[0], None
    values = readers.as_rows(tensors["weight"], rows)
    if f.decode == "mxfp8":
        return values, _uint8(readers.as_rows(tensors["weight_scale"], rows)), None
    return values, None, tensors["weight_scale"]


def _uint8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def views(
    values: torch.Tensor, scales: torch.Tensor, dims: tuple[int, int, int, int]
) -> dict[str, MXFP8Weight]:
    """W_UK_T ``[N, P, L]`` and W_UV ``[N, L, V]`` as views of the pack rows."""
    n, p, v, lat = dims
    vals = values[:, :lat].unflatten(0, (n, p + v))
    codes = scales[:, : lat // mxfp8.BLOCK_SIZE].unflatten(0, (n, p + v))
    return {
        "W_UK_T": MXFP8Weight(vals[:, :p, :], codes[:, :p, :]),
        "W_UV": MXFP8Weight(vals[:, p:, :].transpose(1, 2), codes[:, p:, :].transpose(1, 2)),
    }


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _rebind_values(f: forms.KVBForm, module: nn.Module, live: DirectState) -> None:
    """Point kv_b_proj back at the live pack tensors (after their refill)."""
    if f.decode == "mxfp8-b12x":
        packed = getattr(module, forms.B12X_PACKED).weight
        _set_field(packed, "values", live.values)
        scale_rows = packed.scale_rows
        if not _same_storage(scale_rows[0], live.scales):
            _set_field(packed, "scale_rows", live.scales.unsqueeze(0))
        return
    weight = module._parameters["weight"]
    held = readers.as_rows(weight.data, live.values.shape[0])
    if not _same_storage(held, live.values):
        weight.data = live.values if held is weight.data else live.values.t()
    if f.decode == "mxfp8":
        scale = module._parameters["weight_scale"]
        if not _same_storage(
            _uint8(readers.as_rows(scale.data, live.scales.shape[0])), live.scales
        ):
            scale.data = live.scales.view(scale.dtype)


def _set_field(owner: object, name: str, value: torch.Tensor) -> None:
    if dataclasses.is_dataclass(owner):
        object.__setattr__(owner, name, value)  # frozen dataclasses too
    else:
        setattr(owner, name, value)


def _fingerprint(module: nn.Module) -> tuple:
    held = [*forms.module_tensors(module).values()]
    for attr in forms.PACKED_ATTRS:
        held += owner_tensors(getattr(module, attr, None))
    return ("direct", *((t.data_ptr(), t._version, tuple(t.shape)) for t in held))


def post_load_direct(
    layer: nn.Module, act_dtype: torch.dtype, release_swizzled: bool, *, refresh: bool = False
) -> str:
    """Bind the views (first load) or refresh the pack in place (reload); returns the action.

    ``release_swizzled`` frees a swizzled form's original scales after unswizzling (only
    where kv_b_proj is never called). Without ``refresh`` a source that has not changed
    since the last binding is a no-op. Raises DirectModeError for a layer direct mode
    cannot serve; any failure before the commit leaves the layer as it was.
    """
    check_layer(layer, act_dtype)
    module = owner_module(layer.kv_b_proj)
    state = state_of(layer)
    live: DirectState | None = getattr(state, "direct", None)
    if live is not None and not holds_weights(module, forms.PACKED_ATTRS):
        return "noop"
    if live is not None and live.owns_scales and _scales_released(module):
        return "noop"  # nothing new arrived since the swizzled scales were released
    if live is not None and not refresh and state.fingerprint == _fingerprint(module):
        return "noop"
    f = form_of(module)
    dims = layer_dims(layer)
    values, plain, swizzled = pack_tensors(f, module)
    rows, cols = _rows(module)
    groups = cols // mxfp8.BLOCK_SIZE
    faults.begin()
    try:
        staged_scales = plain
        if swizzled is not None:
            faults.site("alloc", "direct scales")
            staged_scales = layouts.unswizzle_128x4(swizzled, rows, groups).contiguous()
        release = None
        if swizzled is not None and release_swizzled:
            source = forms.source_of(f, module, act_dtype)
            release = prepare_release(dataclasses.replace(source, names=("weight_scale",)))
        faults.site("copy", "direct pack")
    except Exception as exc:
        raise PostLoadError.after(
            "direct-mode binding", "pack intact, nothing released", exc
        ) from exc
    if live is None:
        owns = swizzled is not None
        live = DirectState(f.name, values, staged_scales, owns)
        action = "direct"
    else:
        with torch.no_grad():
            if not _same_storage(values, live.values):
                live.values.copy_(values)
            if not _same_storage(staged_scales, live.scales):
                live.scales.copy_(staged_scales)
        _rebind_values(f, module, live)
        action = "direct-reloaded"
    for name, view in views(live.values, live.scales, dims).items():
        _bind_view(layer, name, view, act_dtype)
    if release is not None:
        release.commit()
    state.direct = live
    state.fingerprint = _fingerprint(module)
    state.released = False
    return action


def _scales_released(module: nn.Module) -> bool:
    scale = forms.module_tensors(module).get("weight_scale")
    return scale is not None and scale.numel() == 0


def _bind_view(layer: nn.Module, name: str, view: MXFP8Weight, act_dtype: torch.dtype) -> None:
    current = layer._parameters.get(name)
    if (
        isinstance(current, AbsorbedWeight)
        and current.kind == "mxfp8"
        and _same_storage(current._values, view.values)
        and _same_storage(current._scales, _uint8(view.scales))
        and current.dtype == act_dtype
    ):
        return  # already these views
    layer.__dict__.pop(name, None)
    layer._buffers.pop(name, None)
    weight = AbsorbedWeight.mxfp8(view, act_dtype, name)
    layer._parameters[name] = nn.Parameter(weight, requires_grad=False)
