"""DeepSeek-V4's fp8 KV record (``vllm_mla.ops.dsv4.record``): layout, scale rule, error."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_mla.formats import DSV4_RECORD
from vllm_mla.ops.dsv4 import record

B = 4  # tokens a page


def rows(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 512, generator=gen) * torch.logspace(-3, 3, n)[:, None]
    return x.bfloat16().float()


def test_a_page_holds_data_rows_then_scale_rows():
    cache = torch.zeros(2, B * DSV4_RECORD, dtype=torch.uint8)
    x = rows(4)
    record.write(cache, x, torch.tensor([5, -1, 0, 6]), B)  # slot -1: no token
    # token 0 at block 1 row 1: its data row at 576, its scale row after all data rows
    data, scales = record.quantize(x[:1])
    assert torch.equal(cache[1, 576 : 2 * 576], data[0])
    assert torch.equal(cache[1, B * 576 + 8 : B * 576 + 16], scales[0])
    assert scales[0, 7] == 0  # the pad byte
    # RoPE values are the row's bf16 bytes, little-endian
    assert torch.equal(cache[1, 576 + 448 : 2 * 576].view(torch.bfloat16), x[0, 448:].bfloat16())
    assert cache[0, 576 : 2 * 576].eq(0).all()  # row 1 of block 0: nothing written
    back = record.read(cache, torch.tensor([[5, 0], [-1, 6]]), B)
    assert back.shape == (2, 2, 512) and back[1, 0].eq(0).all()


@pytest.mark.parametrize(("writer", "zero_code"), [("cpu", 127 - 13), ("triton", 127 - 22)])
def test_the_scale_is_the_power_of_two_that_fits_the_block_under_448(writer, zero_code):
    """``2**ceil(log2(amax / 448))``; an all-zero block meets the writer's floor: vLLM CPU's
    floors the scale at 1e-4 (2**-13), vLLM's Triton writers floor the amax at 1e-4
    (2**ceil(log2(1e-4 / 448)) = 2**-22)."""
    x = torch.zeros(4, 512)
    x[0, :64] = torch.linspace(-448 * 4, 448 * 4, 64)  # amax exactly 448 * 2**2
    x[1, :64] = 448 * 4 * (1 + 2**-7)  # just above (on the bf16 grid): the next power
    x[2, 64:128] = 3.0
    _, scales = record.quantize(x, writer)
    assert scales[0, 0] == 127 + 2 and scales[1, 0] == 127 + 3
    assert (
        scales[2, 0]
        == zero_code
        == 127 + math.ceil(math.log2(1e-4 if writer == "cpu" else 1e-4 / 448))
    )
    assert scales[2, 1] == 127 + math.ceil(math.log2(3 / 448))
    ends = record.dequantize(*record.quantize(x, writer))[0, [0, 63]]
    assert ends.tolist() == [-448 * 4, 448 * 4]  # amax maps to 448 exactly


@pytest.mark.parametrize("writer", ["cpu", "triton"])
def test_values_come_back_within_e4m3s_step(writer):
    """e4m3 keeps 3 mantissa bits: a normal value is off by at most 2**-4 of itself. Under
    e4m3's smallest normal (2**-6 of the scale) the Triton writers keep subnormals (off by
    at most half their step, 2**-10 of the scale) and vLLM CPU's store a zero of the value's
    sign (off by at most 2**-6 of the scale). RoPE values are bf16 and come back exactly."""
    x = rows(16)
    x[0, :64] = torch.linspace(-1, 1, 64)  # values of every magnitude under one scale
    data, scales = record.quantize(x, writer)
    back = record.dequantize(data, scales)
    scale = torch.exp2(scales[:, :7].float() - 127).repeat_interleave(64, dim=1)
    small = 2**-10 if writer == "triton" else 2**-6
    bound = torch.maximum(x[:, :448].abs() * 2**-4, scale * small)
    assert ((back[:, :448] - x[:, :448]).abs() <= bound).all()
    flushed = (back[:, :448] == 0) & (x[:, :448] != 0)
    assert flushed.any() == (writer == "cpu")
    assert torch.equal(torch.signbit(back[:, :448][flushed]), torch.signbit(x[:, :448][flushed]))
    assert torch.equal(back[:, 448:], x[:, 448:])
    assert torch.equal(record.dequantize(*record.quantize(back, writer)), back)  # idempotent


def test_a_wrong_width_or_page_names_the_shape():
    with pytest.raises(ValueError, match=r"a DeepSeek-V4 KV row is 512 wide, got \(2, 576\)"):
        record.quantize(torch.zeros(2, 576))
    with pytest.raises(ValueError, match=r"writer must be one of \('cpu', 'triton'\), got 'gpu'"):
        record.quantize(torch.zeros(2, 512), "gpu")
    with pytest.raises(ValueError, match="a page of 4 DeepSeek-V4 records is 2336 bytes, got 2304"):
        record.read(torch.zeros(1, 2304, dtype=torch.uint8), torch.tensor([0]), 4)
