"""vLLM integration tests: run in the vLLM environment (.venv-vllm), on CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest
import torch
from torch import nn

from vllm_mla.quant import fp8_block
from vllm_mla.vllm import plugin

N, P, V, L = 4, 64, 64, 128  # rows N*(P+V) = 512 and L = 128: whole 128x128 FP8 blocks


@pytest.fixture
def registered(monkeypatch):
    """The plugin applied with default settings; everything reverted afterwards."""
    monkeypatch.delenv("VLLM_MLA", raising=False)
    monkeypatch.delenv("VLLM_MLA_FEATURES", raising=False)
    plugin.reset()
    yield plugin.register()
    plugin.reset()


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    yield
    plugin.reset()


def fp8_method():
    """A real vLLM Fp8LinearMethod in its block-quantized, plain-torch configuration."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    method = Fp8LinearMethod.__new__(Fp8LinearMethod)
    method.block_quant = True
    method.use_marlin = False
    method.use_deep_gemm = False
    return method


def kv_b_proj(fmt: str, seed: int = 0) -> nn.Module:
    """kv_b_proj as vLLM's linear layers hold it after their own post-load."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(N * (P + V), L, generator=gen) * 0.05
    module = nn.Module()
    module.output_size_per_partition, module.input_size_per_partition = weight.shape
    if fmt == "bf16":
        module.quant_method = None
        module.weight = nn.Parameter(weight.bfloat16(), requires_grad=False)
    else:
        q = fp8_block.quantize(weight)
        module.quant_method = fp8_method()
        module.weight_block_size = [128, 128]
        module.weight = nn.Parameter(q.values, requires_grad=False)
        module.weight_scale_inv = nn.Parameter(q.scale_inv, requires_grad=False)
    module.weight.weight_loader = lambda param, loaded: param.data.copy_(loaded)
    return module


def mla_layer(fmt: str, seed: int = 0, backend: str | None = None, dense_prefill: bool = True):
    """An MLAAttention built as vLLM's own CPU post-load test builds it."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = MLAAttention.__new__(MLAAttention)
    nn.Module.__init__(layer)
    layer.kv_lora_rank, layer.num_heads = L, N
    layer.qk_nope_head_dim, layer.v_head_dim = P, V
    layer.kv_b_proj = kv_b_proj(fmt, seed)
    layer.is_aiter_triton_fp4_bmm_enabled = False
    layer.is_aiter_triton_fp8_bmm_enabled = False
    layer.is_amx_bmm_enabled = False
    layer.dcp_q_replicate = False
    layer.quant_config = None
    layer.layer_name = "model.layers.0.self_attn.attn"
    layer.impl = SimpleNamespace(
        process_weights_after_loading=lambda act_dtype: None,
        supports_dense_mha_prefill=dense_prefill,
    )
    if not dense_prefill:
        layer.prefill_backend = None
    if backend is not None:
        layer.attn_backend = SimpleNamespace(get_name=lambda: backend)
    return layer
