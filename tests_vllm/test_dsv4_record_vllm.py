"""Our DeepSeek-V4 record codec (``vllm_mla.ops.dsv4.record``) against vLLM CPU's own
writer, ``fused_qnorm_rope_kv_insert_cpu`` (``_C`` only: AVX-512 BF16 hosts)."""

from __future__ import annotations

import pytest
import torch

from vllm_mla.formats import DSV4_RECORD
from vllm_mla.ops.dsv4 import record
from vllm_mla.vllm.sparse import dsv4_ops

pytest.importorskip("vllm.models.deepseek_v4.cpu.cpu_sparse")
B, T, H = 64, 70, 2  # tokens a page, tokens written, heads


def gptj_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """GPT-J (interleaved pairs) rotation of the last 64 values, in fp32."""
    cos, sin = cos_sin[positions, :32], cos_sin[positions, 32:]
    even, odd = x[:, 448::2], x[:, 449::2]
    out = x.clone()
    out[:, 448::2] = even * cos - odd * sin
    out[:, 449::2] = even * sin + odd * cos
    return out


@pytest.mark.skipif(
    not dsv4_ops.vllms("fused_qnorm_rope_kv_insert_cpu"), reason="vLLM's V4 kernels are absent here"
)
def test_vllms_writer_stores_our_record_byte_for_byte():
    gen = torch.Generator().manual_seed(0)
    kv = (torch.randn(T, 512, generator=gen) * torch.logspace(-4, 2, T)[:, None]).bfloat16()
    kv[3, :64] = 0  # an all-zero block: the amax floor
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    positions = torch.randint(0, 1000, (T,), generator=gen)
    angles = torch.arange(1000)[:, None] * 10000.0 ** (-torch.arange(32) / 32)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).float().contiguous()
    slots = torch.randperm(3 * B, generator=gen)[:T]
    slots[5] = -1  # a padded token
    cache = torch.zeros(3, B * DSV4_RECORD, dtype=torch.uint8)
    torch.ops._C.fused_qnorm_rope_kv_insert_cpu(q, kv, positions, cache, slots, cos_sin, H, 1e-6, B)
    ours = torch.zeros_like(cache)
    rotated = gptj_rope(kv.float(), positions, cos_sin)
    record.write(ours, rotated, slots, B)
    data_v, scales_v = record._split(cache, B)
    data_o, scales_o = record._split(ours, B)
    # NoPE values and scales: the same bytes; RoPE values: the same rotation, rounded to
    # bf16 once (at most one bf16 step apart where the fp32 products round differently)
    assert torch.equal(data_v[..., :448], data_o[..., :448])
    assert torch.equal(scales_v, scales_o)
    got, want = record.read(cache, slots, B), record.read(ours, slots, B)
    step = (got[:, 448:] - want[:, 448:]).abs() / want[:, 448:].abs().clamp_min(1e-30)
    assert step.max() <= 2.0**-8, step.max()
    assert got[5].eq(0).all() and cache.view(3, -1)[:, : B * 576].count_nonzero() > 0
