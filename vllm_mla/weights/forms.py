"""The kv_b_proj matrix: every form vLLM 0.32/0.33 builds for MLA models, and how to read it.

A *form* is (quant method family x the kernel backend vLLM selects) -> the tensors left
on kv_b_proj after that method's own ``process_weights_after_loading``. Each row says
how the lifecycle produces the absorbed pair from those tensors (``decode``), how
upstream's MLA post-load does it (``upstream``, which ``qualify`` models for the
baseline), and where vLLM selects it. The README's matrix is rendered from ``FORMS``
(a test keeps them equal).

Detection reads only names and tensors (no vLLM import): the quant method's class,
the kernel object it selected (``fp8_linear``, ``kernel``, ``scheme.kernel``,
``scheme.ocp_mx_linear``) and the tensors' dtypes and shapes. A kv_b_proj in no row
(another quant method, another kernel, or a known kernel leaving tensors we do not
expect) is *unknown*: the plugin hands it to upstream's post-load untouched.

Release frees every source tensor of the form (all of the module's parameters and
buffers, ``None`` skipped, plus its packed owners). Reload: vLLM's layerwise reload
refills the released placeholders and reruns the method's post-load (which rebuilds
any packed owner); the lifecycle then refills the pair in place and releases again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from vllm_mla.formats import FP8_BLOCK
from vllm_mla.quant import layouts, mxfp8
from vllm_mla.weights import readers
from vllm_mla.weights.sources import (
    KVBSource,
    SourceError,
    holds_weights,
    module_tensors,
    owner_module,
)

Decode = Literal[
    "dense", "fp8-block", "fp8-ue8m0-rows", "mxfp8", "mxfp8-swizzled", "mxfp8-b12x", "apply"
]
Upstream = Literal["cast", "scaled-dequantize", "apply-eye"]
Family = Literal["unquantized", "fp8-block", "mxfp8"]

FORM_ATTR = "vllm_mla_form"  # set on vllm-mla's own stand-in layers (qualify, tests)
B12X_PACKED = "b12x_mxfp8_packed_weight"
KERNEL_ATTRS = ("fp8_linear", "kernel")  # on the quant method
SCHEME_KERNEL_ATTRS = ("kernel", "ocp_mx_linear")  # on layer.scheme (compressed-tensors, Quark)
DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
E8M0 = (torch.uint8, torch.float8_e8m0fnu)


@dataclass(frozen=True)
class KVBForm:
    """One row of the kv_b_proj matrix."""

    name: str
    family: Family
    kernels: tuple[str, ...]  # vLLM kernel classes covered (empty: unquantized)
    selected: str  # where vLLM selects it
    tensors: str  # what the method's post-load leaves on kv_b_proj
    decode: Decode
    upstream: Upstream
    w8a8: bool = False  # upstream's apply(eye) quantizes the identity first (temporaries)
    packed: tuple[str, ...] = ()  # packed-owner attributes
    note: str = ""

    @property
    def bounded(self) -> bool:
        """Scratch bounded by ``max_scratch_bytes`` (apply: up to the kernel's own)."""
        return self.decode != "apply"


FP8_PLAIN = (
    "CutlassFp8BlockScaledMMKernel",
    "TritonFp8BlockScaledMMKernel",
    "BlockWiseTorchFP8ScaledMMLinearKernel",
    "B12xFp8BlockScaledMMKernel",
    "CPUFp8BlockScaledMMKernel",
    "CPUFp8W8A8BlockScaledMMKernel",
    "XPUFp8BlockScaledMMKernel",
)
FP8_DEEPGEMM = ("DeepGemmFp8BlockScaledMMKernel", "FlashInferFp8DeepGEMMDynamicBlockScaledKernel")
MXFP8_METHODS = (
    "ModelOptLinearMethod (quant_algo MXFP8), CompressedTensorsW8A8Mxfp8, QuarkOCP_MX "
    "(mxfp8_e4m3), Mxfp8OnlineLinearMethod"
)

FORMS: tuple[KVBForm, ...] = (
    *(
        KVBForm(
            name,
            "unquantized",
            (),
            "UnquantizedLinearMethod, every platform",
            f"weight {name} [N, K]",
            "dense",
            "cast",
            note="a kept weight already in the activation dtype is aliased, as upstream does",
        )
        for name in DENSE_DTYPES
    ),
    KVBForm(
        "fp8-block",
        "fp8-block",
        FP8_PLAIN,
        "Fp8LinearMethod 128x128 without DeepGEMM: CUTLASS/Triton/torch where DeepGEMM is "
        "unsupported or VLLM_USE_DEEP_GEMM=0, b12x FP8 on SM12x, CPU AMX, XPU",
        "weight e4m3 [N, K], weight_scale_inv fp32 [N/128, K/128] (the checkpoint's)",
        "fp8-block",
        "scaled-dequantize",
        note="with DeepGEMM supported but not selected, upstream takes apply(eye): same values",
    ),
    KVBForm(
        "fp8-block-deepgemm",
        "fp8-block",
        FP8_DEEPGEMM,
        "Fp8LinearMethod 128x128 on SM90 (H100/H200), the default (use_deep_gemm on)",
        "weight e4m3 [N, K] requantized in place with power-of-two scales "
        "(VLLM_USE_DEEP_GEMM_E8M0=1, default), weight_scale_inv fp32 [N/128, K/128]",
        "fp8-block",
        "apply-eye",
        w8a8=True,
        note="the values are DeepGEMM's requantized ones, which upstream's pair holds too",
    ),
    KVBForm(
        "fp8-block-deepgemm-packed",
        "fp8-block",
        FP8_DEEPGEMM,
        "Fp8LinearMethod 128x128 on SM100/SM120 (B200, RTX PRO 6000), the default",
        "weight e4m3 [N, K] requantized (UE8M0), weight_scale_inv int32 [N, K/512] packed "
        "UE8M0 exponents per output row, strides (1, align(N, 4))",
        "fp8-ue8m0-rows",
        "apply-eye",
        w8a8=True,
    ),
    KVBForm(
        "fp8-block-marlin",
        "fp8-block",
        ("MarlinFP8ScaledMMLinearKernel",),
        "Fp8LinearMethod 128x128 on SM80/SM89 (A100, L40S, RTX 4090): weight-only Marlin",
        "weight int32 [K/16, 4N] (Marlin tiles), weight_scale_inv bf16 [K/128, N] "
        "(expanded, permuted, x 2^120)",
        "apply",
        "apply-eye",
        note="read through Marlin's own GEMM on identity slices (its repack is a CUDA op "
        "we do not re-implement); BF16-rounded block scales, as upstream's pair",
    ),
    KVBForm(
        "fp8-block-humming",
        "fp8-block",
        ("HummingFP8ScaledMMLinearKernel",),
        "Fp8LinearMethod with the humming package, opt-in (--linear-backend humming)",
        "humming's own repacked tensors (weight_scale_inv renamed weight_scale)",
        "apply",
        "apply-eye",
        note="without DeepGEMM support (SM80/SM89) upstream's post-load fails on it: it "
        "takes scaled_dequantize, which cannot read the renamed tensors",
    ),
    KVBForm(
        "mxfp8",
        "mxfp8",
        (
            "RocmDotScaledMxfp8LinearKernel",
            "EmulationMxfp8LinearKernel",
            "XPUMxFp8LinearKernel",
            "TorchMxFp8LinearKernel",
        ),
        f"{MXFP8_METHODS}: ROCm gfx95x native, emulation with "
        "VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=0, XPU",
        "weight e4m3 [N, K], weight_scale E8M0 [N, K/32] (uint8, or float8_e8m0fnu as a "
        "transposed view on XPU)",
        "mxfp8",
        "apply-eye",
        w8a8=True,
    ),
    KVBForm(
        "mxfp8-emulation",
        "mxfp8",
        ("EmulationMxfp8LinearKernel",),
        f"{MXFP8_METHODS}: emulation (ROCm before gfx95x, CUDA without a faster kernel), "
        "default VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=1",
        "weight bf16 [N, K] (dequantized at load), weight_scale uint8 [N, K/32] (unused)",
        "dense",
        "apply-eye",
    ),
    KVBForm(
        "mxfp8-flashinfer",
        "mxfp8",
        ("FlashInferCutlassMxfp8LinearKernel", "TorchMxFp8LinearKernel"),
        f"{MXFP8_METHODS}: FlashInfer CUTLASS, the default on SM120/SM121 (and SM100 "
        "without CuTe-DSL); torch._scaled_mm on CUDA (opt-in)",
        "weight e4m3 [N, K], weight_scale flat 128x4-swizzled E8M0 (uint8 or e8m0)",
        "mxfp8-swizzled",
        "apply-eye",
        w8a8=True,
    ),
    KVBForm(
        "mxfp8-cutedsl",
        "mxfp8",
        ("FlashInferCutedslMxfp8LinearKernel",),
        f"{MXFP8_METHODS}: FlashInfer CuTe-DSL, the default on SM100/SM103 (B200)",
        "weight e4m3 [K, N] (transposed view of [N, K]), weight_scale flat 128x4-swizzled",
        "mxfp8-swizzled",
        "apply-eye",
        w8a8=True,
    ),
    KVBForm(
        "mxfp8-b12x",
        "mxfp8",
        ("B12xMxfp8LinearKernel",),
        f"{MXFP8_METHODS}: b12x on SM12x (--linear-backend b12x, or FlashInfer absent)",
        "weight and weight_scale emptied to (0,); packed owner b12x_mxfp8_packed_weight: "
        "weight.values e4m3 [N, K_pad], weight.scale_rows e8m0 [1, N, K_pad/32], "
        "weight.scale_mma (swizzled view)",
        "mxfp8-b12x",
        "apply-eye",
        w8a8=True,
        packed=(B12X_PACKED,),
    ),
    KVBForm(
        "mxfp8-marlin",
        "mxfp8",
        ("MarlinMxfp8LinearKernel",),
        f"{MXFP8_METHODS}: Marlin W8A16, the default on SM80/SM89",
        "weight int32 [K/16, 4N] (Marlin tiles), weight_scale e8m0 [K/32, N] (permuted)",
        "apply",
        "apply-eye",
    ),
    KVBForm(
        "mxfp8-humming",
        "mxfp8",
        ("HummingMxfp8LinearKernel",),
        f"{MXFP8_METHODS}: humming, the default on SM90 (H100/H200)",
        "humming's own repacked tensors (every parameter re-registered)",
        "apply",
        "apply-eye",
    ),
    KVBForm(
        "mxfp8-trtllm",
        "mxfp8",
        ("FlashInferTrtllmMxfp8LinearKernel",),
        f"{MXFP8_METHODS}: FlashInfer TRT-LLM on SM100 (opt-in)",
        "weight e4m3 [N_pad, K] row-shuffled, weight_scale shuffled + 128x4-interleaved",
        "apply",
        "apply-eye",
        w8a8=True,
    ),
)
BY_NAME: dict[str, KVBForm] = {f.name: f for f in FORMS}
PACKED_ATTRS: tuple[str, ...] = tuple(dict.fromkeys(a for f in FORMS for a in f.packed))
FORM_NAMES: tuple[str, ...] = tuple(BY_NAME)


def form(name: str) -> KVBForm:
    """The row called ``name``; KeyError names the known rows."""
    if name not in BY_NAME:
        raise KeyError(f"unknown kv_b_proj form {name!r}; known: {', '.join(FORM_NAMES)}")
    return BY_NAME[name]


# -- detection ------------------------------------------------------------------------------


def kernel_name(module: nn.Module) -> str | None:
    """Class name of the linear kernel vLLM selected for ``module`` (None: no kernel)."""
    method = getattr(module, "quant_method", None)
    holders = [(method, KERNEL_ATTRS), (getattr(module, "scheme", None), SCHEME_KERNEL_ATTRS)]
    for holder, attrs in holders:
        for attr in attrs:
            kernel = getattr(holder, attr, None) if holder is not None else None
            if kernel is not None:
                return type(kernel).__name__
    return None


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    return module_tensors(module).get(name)


def _bad(module: nn.Module, name: str, want: str) -> str:
    t = _tensor(module, name)
    got = "absent" if t is None else f"{t.dtype} {tuple(t.shape)} strides {t.stride()}"
    return f"kv_b_proj.{name}: expected {want}, got {got}"


def _dense_mismatch(f: KVBForm, module: nn.Module, rows: int, cols: int) -> str | None:
    weight = _tensor(module, "weight")
    want = DENSE_DTYPES.get(f.name, torch.bfloat16)
    dtypes = (want,) if f.family == "unquantized" else (torch.bfloat16, torch.float16)
    if weight is None or weight.dtype not in dtypes or tuple(weight.shape) != (rows, cols):
        return _bad(module, "weight", f"{'/'.join(map(str, dtypes))} {(rows, cols)}")
    return None


def _b12x_mismatch(f: KVBForm, module: nn.Module, rows: int, cols: int) -> str | None:
    packed = getattr(module, B12X_PACKED, None)
    values = getattr(getattr(packed, "weight", None), "values", None)
    scales = getattr(getattr(packed, "weight", None), "scale_rows", None)
    if not isinstance(values, torch.Tensor) or not isinstance(scales, torch.Tensor):
        return f"kv_b_proj.{B12X_PACKED}: expected weight.values and weight.scale_rows"
    if values.shape[0] != rows or values.shape[1] < cols or scales.shape[-2] != rows:
        return (
            f"kv_b_proj.{B12X_PACKED}: values {tuple(values.shape)} / scale_rows "
            f"{tuple(scales.shape)} do not hold [{rows}, {cols}]"
        )
    return None


def _fp8_values_mismatch(module: nn.Module, rows: int, cols: int) -> str | None:
    weight = _tensor(module, "weight")
    values = readers.as_rows(weight, rows) if weight is not None else None
    if values is None or values.dtype != torch.float8_e4m3fn or tuple(values.shape) != (rows, cols):
        return _bad(module, "weight", f"float8_e4m3fn {(rows, cols)} (or its transposed view)")
    return None


def _fp8_block_scales_mismatch(module: nn.Module, rows: int, cols: int) -> str | None:
    scale = _tensor(module, "weight_scale_inv")
    blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
    if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != blocks:
        return _bad(module, "weight_scale_inv", f"float32 {blocks}")
    return None


def _ue8m0_rows_scales_mismatch(module: nn.Module, rows: int, cols: int) -> str | None:
    scale = _tensor(module, "weight_scale_inv")
    col_blocks = -(-cols // FP8_BLOCK)
    words = -(-col_blocks // layouts.UE8M0_PER_WORD)
    if scale is None or scale.dtype != torch.int32 or tuple(scale.shape) != (rows, words):
        return _bad(module, "weight_scale_inv", f"int32 {(rows, words)} (packed UE8M0)")
    return None


def _mxfp8_scales_mismatch(module: nn.Module, rows: int, cols: int) -> str | None:
    scale = _tensor(module, "weight_scale")
    held = readers.as_rows(scale, rows) if scale is not None else None
    groups = cols // mxfp8.BLOCK_SIZE
    if held is None or held.dtype not in E8M0 or tuple(held.shape) != (rows, groups):
        return _bad(module, "weight_scale", f"uint8/float8_e8m0fnu {(rows, groups)}")
    return None


def _swizzled_scales_mismatch(module: nn.Module, rows: int, cols: int) -> str | None:
    scale = _tensor(module, "weight_scale")
    numel = layouts.swizzled_numel(rows, cols // mxfp8.BLOCK_SIZE)
    if scale is None or scale.dtype not in E8M0 or scale.dim() != 1 or scale.numel() != numel:
        return _bad(module, "weight_scale", f"flat 128x4-swizzled E8M0 of {numel} bytes")
    return None


# Per decode: the scale check after the e4m3 values' (quantized rows), or the whole check.
_SCALE_CHECKS = {
    "fp8-block": _fp8_block_scales_mismatch,
    "fp8-ue8m0-rows": _ue8m0_rows_scales_mismatch,
    "mxfp8": _mxfp8_scales_mismatch,
    "mxfp8-swizzled": _swizzled_scales_mismatch,
}
_WHOLE_CHECKS = {
    "dense": _dense_mismatch,
    "apply": lambda f, module, rows, cols: None,  # the kernel's own layout: its GEMM reads it
    "mxfp8-b12x": _b12x_mismatch,
}


def _layout_mismatch(f: KVBForm, module: nn.Module, rows: int, cols: int) -> str | None:
    """Why ``module``'s tensors are not what row ``f`` leaves (None: they are)."""
    whole = _WHOLE_CHECKS.get(f.decode)
    if whole is not None:
        return whole(f, module, rows, cols)
    return _fp8_values_mismatch(module, rows, cols) or _SCALE_CHECKS[f.decode](module, rows, cols)


def _candidates(module: nn.Module) -> tuple[list[KVBForm], str]:
    """Rows that may describe ``module``, and what identified them (for messages)."""
    own = getattr(module, FORM_ATTR, None)
    if own is not None:
        return [form(own)], f"vllm-mla stand-in {own}"
    method = getattr(module, "quant_method", None)
    method_name = type(method).__name__
    if method is None or method_name == "UnquantizedLinearMethod":
        return [f for f in FORMS if f.family == "unquantized"], "unquantized"
    kernel = kernel_name(module)
    label = f"{method_name} + {kernel or 'no kernel'}"
    if kernel is None:
        return [], label
    rows = [f for f in FORMS if kernel in f.kernels]
    if any(f.family == "fp8-block" for f in rows):
        block = list(getattr(module, "weight_block_size", None) or ())
        if method_name != "Fp8LinearMethod" or block != [128, 128]:
            return [], f"{label} (block {block or None})"
    return rows, label


def _dims(module: nn.Module) -> tuple[int, int] | None:
    """``[out, in]`` of kv_b_proj: vLLM's partition sizes, else its 2-D weight's shape."""
    rows = getattr(module, "output_size_per_partition", None)
    cols = getattr(module, "input_size_per_partition", None)
    if rows is not None and cols is not None:
        return int(rows), int(cols)
    weight = _tensor(module, "weight")
    return tuple(weight.shape) if weight is not None and weight.dim() == 2 else None


def detect(kv_b_proj: nn.Module) -> tuple[KVBForm | None, str]:
    """(the row describing kv_b_proj, what identified it) or (None, why it is unknown)."""
    module = owner_module(kv_b_proj)
    candidates, label = _candidates(module)
    if not candidates:
        return None, f"unknown kv_b_proj form ({label})"
    dims = _dims(module)
    if dims is None:
        return None, f"kv_b_proj ({label}) has no 2-D weight and no partition sizes"
    reasons = []
    for f in candidates:
        reason = _layout_mismatch(f, module, *dims)
        if reason is None:
            return f, label
        reasons.append(f"{f.name}: {reason}")
    return None, f"unknown kv_b_proj form ({label}): " + "; ".join(reasons)


# -- reading ----------------------------------------------------------------------------------


def _reader(f: KVBForm, module: nn.Module, act_dtype: torch.dtype, rows: int):
    weight = _tensor(module, "weight")
    if f.decode == "dense":
        return readers.dense(weight)
    if f.decode == "fp8-block":
        return readers.fp8_block(weight, _tensor(module, "weight_scale_inv"))
    if f.decode == "fp8-ue8m0-rows":
        return readers.fp8_ue8m0_rows(weight, _tensor(module, "weight_scale_inv"))
    if f.decode == "mxfp8":
        return readers.mxfp8_rows(weight, _tensor(module, "weight_scale"), rows)
    if f.decode == "mxfp8-swizzled":
        return readers.mxfp8_swizzled(weight, _tensor(module, "weight_scale"), rows)
    if f.decode == "mxfp8-b12x":
        packed = getattr(module, B12X_PACKED)
        cols = int(packed.in_features)
        values = packed.weight.values[:, :cols]
        scales = packed.weight.scale_rows[0, :, : cols // mxfp8.BLOCK_SIZE]
        return readers.mxfp8_rows(values, scales, rows)
    method = getattr(module, "quant_method", None)
    if method is None or not callable(getattr(method, "apply", None)):
        raise SourceError(f"kv_b_proj ({f.name}) has no quant_method.apply to read it through")
    return readers.apply_identity(module, method, act_dtype)


def source_of(
    f: KVBForm, kv_b_proj: nn.Module, act_dtype: torch.dtype = torch.bfloat16
) -> KVBSource | None:
    """The source of ``kv_b_proj`` read as row ``f``; None when it was released."""
    module = owner_module(kv_b_proj)
    tensors = module_tensors(module)
    packed = tuple(a for a in f.packed if getattr(module, a, None) is not None)
    if not packed and not any(t.numel() for t in tensors.values()):
        return None
    dims = _dims(module)
    if dims is None:
        raise SourceError(f"kv_b_proj ({f.name}) has no 2-D weight and no partition sizes")
    return KVBSource(
        form=f.name,
        module=module,
        shape=dims,
        reader=_reader(f, module, act_dtype, dims[0]),
        names=tuple(tensors),
        packed=packed,
        dense=tensors["weight"] if f.family == "unquantized" else None,
    )


def read_source(kv_b_proj: nn.Module, act_dtype: torch.dtype = torch.bfloat16) -> KVBSource | None:
    """The source of ``kv_b_proj`` in its detected form (None: released).

    Raises SourceError naming the tensors when the form is unknown.
    """
    module = owner_module(kv_b_proj)
    f, why = detect(module)
    if f is None:
        if not holds_weights(module, PACKED_ATTRS):
            return None  # released: nothing left to detect
        raise SourceError(why)
    return source_of(f, module, act_dtype)


_DECODE_TEXT = {
    "dense": "views of the weight (no scratch)",
    "fp8-block": "our block-FP8 codec, head groups",
    "fp8-ue8m0-rows": "our codec on DeepGEMM's packed scales, head groups",
    "mxfp8": "our MXFP8 codec, head groups",
    "mxfp8-swizzled": "our MXFP8 codec, scales unswizzled per 128-row tile, head groups",
    "mxfp8-b12x": "our MXFP8 codec on the packed owner's rows, head groups",
    "apply": "vLLM's own GEMM on identity slices (latent columns)",
}
_UPSTREAM_TEXT = {
    "cast": "weight.to(dtype)",
    "scaled-dequantize": "whole layer in fp32 (scaled_dequantize)",
    "apply-eye": "apply(layer, eye[K, K]) in the activation dtype",
}


def matrix_markdown() -> str:
    """The kv_b_proj matrix as the README shows it (a test keeps the README equal)."""
    lines = [
        "| form (`--weights`) | vLLM method x kernel, where selected | left on kv_b_proj after "
        "its post-load | pair produced by | scratch | upstream's dequant |",
        "|---|---|---|---|---|---|",
    ]
    for f in FORMS:
        scratch = "bounded" if f.bounded else "bounded, plus the kernel's own workspace"
        what = f.tensors + (f" ({f.note})" if f.note else "")
        lines.append(
            f"| `{f.name}` | {f.selected} | {what} | {_DECODE_TEXT[f.decode]} | {scratch} | "
            f"{_UPSTREAM_TEXT[f.upstream]} |"
        )
    return "\n".join(lines)
