"""A stand-alone MLA layer shell: the attributes vLLM's MLAAttention exposes to post-load.

Used by ``vllm-mla qualify`` and the tests so the lifecycle runs without vLLM. The
source tensors are built by ``source_tensors`` in any of the supported formats.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from vllm_mla.geometry import RankGeometry
from vllm_mla.quant import fp8_block, mxfp8

WeightFormat = Literal["bf16", "fp32", "fp8-block", "mxfp8"]
WEIGHT_FORMATS: tuple[str, ...] = ("bf16", "fp32", "fp8-block", "mxfp8")


class KVBProj(nn.Module):
    """Holds kv_b_proj's checkpoint tensors as parameters, as a vLLM linear layer does."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


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


def source_tensors(weight: torch.Tensor, fmt: WeightFormat) -> dict[str, torch.Tensor]:
    """kv_b_proj tensors for ``weight`` in checkpoint format ``fmt`` (named as vLLM names them)."""
    if fmt == "bf16":
        return {"weight": weight.to(torch.bfloat16)}
    if fmt == "fp32":
        return {"weight": weight.to(torch.float32)}
    if fmt == "fp8-block":
        q = fp8_block.quantize(weight)
        return {"weight": q.values, "weight_scale_inv": q.scale_inv}
    if fmt == "mxfp8":
        q = mxfp8.quantize(weight, axis=-1, scale_mode="rceil")
        return {"weight": q.values, "weight_scale": q.scales}
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {WEIGHT_FORMATS}")


def build_layer(
    geo: RankGeometry, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu"
) -> MLALayer:
    """A fresh layer owning its own copy of ``tensors`` on ``device``."""
    owned = {name: t.to(device, copy=True) for name, t in tensors.items()}
    return MLALayer(geo, KVBProj(owned))
