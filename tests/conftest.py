"""Shared fixtures: small MLA layers in every source format."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run in Triton's CPU interpreter where there is no GPU; this must be
# set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vllm_mla.geometry import MLAGeometry, RankGeometry
from vllm_mla.tools.standins import MLALayer, build_layer, source_tensors, synthetic_weight

FORMATS = ("bf16", "fp8-block", "mxfp8")


@pytest.fixture
def geo() -> RankGeometry:
    """Small but awkward: 6 heads (not a power of two), rows not a multiple of 128."""
    return MLAGeometry(6, 48, 16, 64, 40, 3, name="small").shard(1)


def make_layer(geo: RankGeometry, fmt: str, seed: int = 0, layer: int = 0) -> MLALayer:
    """A fresh layer with seeded weights in ``fmt``."""
    weight = synthetic_weight(geo, seed=seed, layer=layer, std=0.5)
    return build_layer(geo, source_tensors(weight, fmt))


def reference_pair(geo: RankGeometry, fmt: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """W_UK_T, W_UV computed directly from the definition (independent of the lifecycle):
    the exact float32 dequantization of the checkpoint tensors, rounded once to bf16."""
    from vllm_mla.quant import fp8_block, mxfp8
    from vllm_mla.tools.standins import checkpoint_tensors

    weight = synthetic_weight(geo, seed=seed, layer=0, std=0.5)
    ckpt = checkpoint_tensors(weight, fmt)
    if fmt == "fp8-block":
        full = fp8_block.dequantize(
            fp8_block.FP8BlockTensor(ckpt["weight"], ckpt["weight_scale_inv"])
        )
    elif fmt == "mxfp8":
        full = mxfp8.dequantize(mxfp8.MXFP8Tensor(ckpt["weight"], ckpt["weight_scale"], axis=1))
    else:
        full = ckpt["weight"]
    full = full.to(torch.bfloat16)
    m = geo.model
    w = full.view(geo.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    w_uk_t = w[:, : m.qk_nope_head_dim, :].contiguous()
    w_uv = w[:, m.qk_nope_head_dim :, :].transpose(1, 2).contiguous()
    return w_uk_t, w_uv
