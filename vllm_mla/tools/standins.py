"""Stand-alone MLA layers holding kv_b_proj in any form of the matrix, without vLLM.

Used by ``vllm-mla qualify`` and the tests so the lifecycle runs without vLLM. A layer is
built in two steps: checkpoint tensors (``checkpoint_tensors``: what a checkpoint of
that family holds), then the form (``form_tensors``: what the kernel's post-load leaves,
modelled with ``vllm_mla.quant.layouts``; the vLLM tests check each model against the
real vLLM classes). Forms only a kernel can read (Marlin, Humming, TRT-LLM) get tensors
of the kernel's shapes and dtypes and a reference GEMM standing in for the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from vllm_mla.geometry import RankGeometry
from vllm_mla.quant import fp8_block, layouts, mxfp8
from vllm_mla.weights.forms import DENSE_DTYPES, FORM_ATTR, FORM_NAMES, KVBForm, form

WEIGHT_FORMATS: tuple[str, ...] = FORM_NAMES
CHECKPOINT_FORMATS = ("bf16", "fp16", "fp32", "fp8-block", "mxfp8")


class ReferenceGemm:
    """Stands in for a kernel's GEMM (``quant_method.apply``): ``x @ W.T`` against the
    exact dequantized weight, held in the activation dtype outside the module's tensors
    (so the ledger never counts it). Each identity row picks one exact product, as the
    real kernels do."""

    def __init__(self, dense: torch.Tensor) -> None:
        self.dense = dense

    def apply(self, layer: nn.Module, x: torch.Tensor, bias=None) -> torch.Tensor:
        return torch.mm(x, self.dense.to(x.device).T)


@dataclass
class FormTensors:
    """What one kv_b_proj holds in a form: tensors, packed owners, a GEMM stand-in."""

    form: str
    tensors: dict[str, torch.Tensor]
    packed: dict[str, object] = field(default_factory=dict)
    gemm: ReferenceGemm | None = None
    shape: tuple[int, int] = (0, 0)  # [out, in] of the dequantized weight


@dataclass(frozen=True)
class PackedRows:
    """Mirrors b12x's ``MXFP8Rows`` fields read by the lifecycle."""

    values: torch.Tensor
    scale_rows: torch.Tensor
    scale_mma: torch.Tensor  # b12x's swizzled copy of the scales (bytes as b12x holds them)


@dataclass(frozen=True)
class PackedMXFP8Weight:
    """Mirrors b12x's ``MXFP8LinearWeight`` (``b12x_mxfp8_packed_weight``)."""

    weight: PackedRows
    in_features: int
    padded_in_features: int
    out_features: int


class KVBProj(nn.Module):
    """Holds kv_b_proj's tensors as parameters, as a vLLM linear layer does."""

    def __init__(self, held: FormTensors) -> None:
        super().__init__()
        setattr(self, FORM_ATTR, held.form)
        self.output_size_per_partition, self.input_size_per_partition = held.shape
        for name, tensor in held.tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        for name, owner in held.packed.items():
            setattr(self, name, owner)
        self.quant_method = held.gemm


class MLALayer(nn.Module):
    """Geometry attributes named as in vLLM's MLAAttention, plus ``kv_b_proj``."""

    def __init__(self, geo: RankGeometry, kv_b_proj: nn.Module) -> None:
        super().__init__()
        self.num_heads = geo.num_heads
        self.qk_nope_head_dim = geo.model.qk_nope_head_dim
        self.qk_rope_head_dim = geo.model.qk_rope_head_dim
        self.v_head_dim = geo.model.v_head_dim
        self.kv_lora_rank = geo.model.kv_lora_rank
        self.kv_b_proj = kv_b_proj


def synthetic_weight(
    geo: RankGeometry, *, seed: int, layer: int, std: float = 0.02
) -> torch.Tensor:
    """Seeded fp32 kv_b_proj weight ``[N * (P + V), L]`` for one rank; padded heads are zero."""
    gen = torch.Generator().manual_seed(seed * 100_003 + layer)
    per_head = geo.model.qk_nope_head_dim + geo.model.v_head_dim
    weight = torch.zeros(geo.kv_b_rows, geo.model.kv_lora_rank)
    real_rows = geo.real_heads * per_head
    weight[:real_rows] = torch.randn(real_rows, geo.model.kv_lora_rank, generator=gen) * std
    return weight


def checkpoint_family(f: KVBForm) -> str:
    """The checkpoint format a form is loaded from (a dense form: its own dtype)."""
    return f.name if f.family == "unquantized" else f.family


def checkpoint_tensors(weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """kv_b_proj tensors of an ``fmt`` checkpoint for ``weight`` (named as vLLM names them)."""
    if fmt in DENSE_DTYPES:
        return {"weight": weight.to(DENSE_DTYPES[fmt])}
    if fmt == "fp8-block":
        q = fp8_block.quantize(weight)
        return {"weight": q.values, "weight_scale_inv": q.scale_inv}
    if fmt == "mxfp8":
        q = mxfp8.quantize(weight, axis=-1, scale_mode="rceil")
        return {"weight": q.values, "weight_scale": q.scales}
    raise ValueError(f"unknown checkpoint format {fmt!r}; expected one of {CHECKPOINT_FORMATS}")


def _dense_of(ckpt: dict[str, torch.Tensor], family: str) -> torch.Tensor:
    """The exact float32 dequantization of checkpoint tensors."""
    if family == "fp8-block":
        return fp8_block.dequantize(
            fp8_block.FP8BlockTensor(ckpt["weight"], ckpt["weight_scale_inv"])
        )
    if family == "mxfp8":
        return mxfp8.dequantize(mxfp8.MXFP8Tensor(ckpt["weight"], ckpt["weight_scale"], axis=1))
    return ckpt["weight"].to(torch.float32)


def form_tensors(
    ckpt: dict[str, torch.Tensor], name: str, act_dtype: torch.dtype = torch.bfloat16
) -> FormTensors:
    """What row ``name``'s post-load leaves on kv_b_proj loaded from ``ckpt``."""
    f = form(name)
    weight = ckpt["weight"]
    rows, cols = weight.shape
    held = FormTensors(name, {}, shape=(rows, cols))
    if f.family == "unquantized":
        held.tensors["weight"] = weight.to(DENSE_DTYPES[name])
        return held
    if f.family == "fp8-block":
        t = fp8_block.FP8BlockTensor(weight, ckpt["weight_scale_inv"])
        if name in ("fp8-block-deepgemm", "fp8-block-deepgemm-packed"):
            t = fp8_block.requantize_ue8m0(t)
        if name == "fp8-block-deepgemm-packed":
            held.tensors.update(
                weight=t.values, weight_scale_inv=layouts.pack_ue8m0_rows(t.scale_inv, rows)
            )
        elif f.decode == "apply":
            held.gemm = ReferenceGemm(fp8_block.dequantize(t).to(act_dtype))
            held.tensors.update(_kernel_shaped(name, rows, cols))
        else:
            held.tensors.update(weight=t.values, weight_scale_inv=t.scale_inv)
        return held
    scales = ckpt["weight_scale"].view(torch.uint8)
    if name == "mxfp8":
        held.tensors.update(weight=weight, weight_scale=scales)
    elif name == "mxfp8-emulation":
        dense = mxfp8.dequantize(mxfp8.MXFP8Tensor(weight, scales, axis=1), torch.bfloat16)
        held.tensors.update(weight=dense, weight_scale=scales)
    elif name in ("mxfp8-flashinfer", "mxfp8-cutedsl"):
        values = weight.contiguous().t() if name == "mxfp8-cutedsl" else weight
        held.tensors.update(weight=values, weight_scale=layouts.swizzle_128x4(scales))
    elif name == "mxfp8-b12x":
        held.tensors.update(weight=weight.new_empty((0,)), weight_scale=scales.new_empty((0,)))
        rows_view = PackedRows(weight, scales.unsqueeze(0), layouts.swizzle_128x4(scales))
        held.packed["b12x_mxfp8_packed_weight"] = PackedMXFP8Weight(rows_view, cols, cols, rows)
    else:  # read through the kernel's GEMM
        held.gemm = ReferenceGemm(_dense_of(ckpt, "mxfp8").to(act_dtype))
        held.tensors.update(_kernel_shaped(name, rows, cols))
    return held


def _kernel_shaped(name: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """Zero tensors of the shapes and dtypes a kernel-owned layout has (bytes only)."""
    if name in ("fp8-block-marlin", "mxfp8-marlin"):
        scale = (
            torch.zeros(cols // 128, rows, dtype=torch.bfloat16)
            if name == "fp8-block-marlin"
            else torch.zeros(cols // mxfp8.BLOCK_SIZE, rows, dtype=torch.uint8)
        )
        key = "weight_scale_inv" if name == "fp8-block-marlin" else "weight_scale"
        return {"weight": torch.zeros(cols // 16, 4 * rows, dtype=torch.int32), key: scale}
    if name == "mxfp8-trtllm":
        padded = -(-rows // 128) * 128
        flat = layouts.swizzled_numel(padded, cols // mxfp8.BLOCK_SIZE)
        return {
            "weight": torch.zeros(padded, cols, dtype=torch.uint8),
            "weight_scale": torch.zeros(flat, dtype=torch.uint8),
        }
    scale_cols = cols // mxfp8.BLOCK_SIZE if name == "mxfp8-humming" else -(-cols // 128)
    scale_dtype = torch.uint8 if name == "mxfp8-humming" else torch.float32
    scale_rows = rows if name == "mxfp8-humming" else -(-rows // 128)
    return {
        "weight": torch.zeros(rows, cols // 4, dtype=torch.int32),
        "weight_scale": torch.zeros(scale_rows, scale_cols, dtype=scale_dtype),
    }


def source_tensors(
    weight: torch.Tensor, name: str, act_dtype: torch.dtype = torch.bfloat16
) -> FormTensors:
    """kv_b_proj in row ``name`` for a float32 ``weight`` (checkpoint, then post-load)."""
    f = form(name)
    return form_tensors(checkpoint_tensors(weight, checkpoint_family(f)), name, act_dtype)


def build_kv_b_proj(held: FormTensors, device: torch.device | str = "cpu") -> KVBProj:
    """A kv_b_proj owning its own copy of ``held``'s tensors on ``device``."""
    copy = FormTensors(
        held.form,
        {name: t.to(device, copy=True) for name, t in held.tensors.items()},
        {name: _owner_to(owner, device) for name, owner in held.packed.items()},
        held.gemm,
        held.shape,
    )
    return KVBProj(copy)


def build_layer(
    geo: RankGeometry, held: FormTensors, device: torch.device | str = "cpu"
) -> MLALayer:
    """A fresh layer owning its own copy of ``held``'s tensors on ``device``."""
    return MLALayer(geo, build_kv_b_proj(held, device))


def _owner_to(owner: PackedMXFP8Weight, device: torch.device | str) -> PackedMXFP8Weight:
    rows = PackedRows(
        *(
            getattr(owner.weight, f).to(device, copy=True)
            for f in ("values", "scale_rows", "scale_mma")
        )
    )
    return PackedMXFP8Weight(rows, owner.in_features, owner.padded_in_features, owner.out_features)
