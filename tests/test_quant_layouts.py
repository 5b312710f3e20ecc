"""Post-load scale layouts: 128x4 swizzle, DeepGEMM's packed UE8M0 rows, UE8M0 requant."""

from __future__ import annotations

import pytest
import torch

from vllm_mla.quant import fp8_block, layouts
from vllm_mla.quant.layouts import LayoutError


def codes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 255, (rows, cols), generator=gen, dtype=torch.uint8)


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (7, 3), (128, 4), (130, 16), (640, 16)])
def test_swizzle_round_trips_and_pads_with_zeros(rows, cols):
    grid = codes(rows, cols)
    flat = layouts.swizzle_128x4(grid)
    assert flat.shape == (layouts.swizzled_numel(rows, cols),)
    assert torch.equal(layouts.unswizzle_128x4(flat, rows, cols), grid)
    assert int(flat.sum()) == int(grid.sum(dtype=torch.int64))  # padding holds zeros


def test_swizzle_puts_each_scale_where_the_128x4_formula_says():
    rows, cols = 256, 8
    grid = codes(rows, cols, seed=1)
    flat = layouts.swizzle_128x4(grid)
    ns = cols // 4
    for m, s in [(0, 0), (31, 3), (32, 0), (127, 7), (128, 1), (255, 6)]:
        offset = (m // 128) * ns * 512 + (s // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4
        assert flat[offset + s % 4] == grid[m, s]


@pytest.mark.parametrize(("start", "stop"), [(0, 1), (5, 140), (127, 129), (300, 640), (640, 640)])
def test_unswizzle_a_row_range_reads_only_its_tiles(start, stop):
    grid = codes(640, 16, seed=2)
    flat = layouts.swizzle_128x4(grid)
    assert torch.equal(layouts.unswizzle_128x4(flat, 640, 16, (start, stop)), grid[start:stop])


def test_unswizzle_refuses_a_wrong_size_naming_it():
    with pytest.raises(LayoutError, match="expected a flat array of 2048 bytes"):
        layouts.unswizzle_128x4(torch.zeros(100, dtype=torch.uint8), 128, 16)
    with pytest.raises(LayoutError, match="row_range"):
        layouts.unswizzle_128x4(torch.zeros(2048, dtype=torch.uint8), 128, 16, (0, 129))


def pow2_scales(blocks: int, kb: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    exps = torch.randint(-20, 5, (blocks, kb), generator=gen)
    return torch.pow(2.0, exps.float())


@pytest.mark.parametrize(("rows", "kb"), [(128, 4), (640, 4), (130, 5), (7, 1), (4096, 4)])
def test_packed_ue8m0_rows_round_trip_with_deepgemms_strides(rows, kb):
    blocks = -(-rows // 128)
    scales = pow2_scales(blocks, kb)
    packed = layouts.pack_ue8m0_rows(scales, rows)
    words = -(-kb // 4)
    assert packed.dtype == torch.int32 and packed.shape == (rows, words)
    assert packed.stride() == (1, -(-rows // 4) * 4)  # MN-major, TMA-aligned
    per_row = layouts.exponent_scales(layouts.unpack_ue8m0_rows(packed, kb))
    assert torch.equal(per_row, scales.repeat_interleave(128, 0)[:rows])
    # a row slice of the strided tensor decodes the same rows
    assert torch.equal(
        layouts.unpack_ue8m0_rows(packed[3:5], kb), layouts.unpack_ue8m0_rows(packed, kb)[3:5]
    )


def test_packing_refuses_scales_that_are_not_powers_of_two():
    with pytest.raises(LayoutError, match="powers of two"):
        layouts.pack_ue8m0_rows(torch.tensor([[0.3]]), 4)
    with pytest.raises(LayoutError, match="words per row"):
        layouts.unpack_ue8m0_rows(torch.zeros(4, 2, dtype=torch.int32), 4)


def test_requantize_ue8m0_gives_the_smallest_power_of_two_scale_that_fits():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 384, generator=gen) * 0.05
    t = fp8_block.quantize(weight)
    r = fp8_block.requantize_ue8m0(t)
    bits = r.scale_inv.view(torch.int32)
    assert not bool((bits & 0x807FFFFF).any())  # positive powers of two
    old = fp8_block.dequantize(t)
    amax = torch.tensor(
        [
            [old[i : i + 128, j : j + 128].abs().max() for j in range(0, 384, 128)]
            for i in range(0, 300, 128)
        ]
    )
    assert bool((amax / r.scale_inv <= 448).all()) and bool((amax / r.scale_inv > 224).all())
    new = fp8_block.dequantize(r)
    assert float(((old - new).abs() / r.scale_inv.max()).max()) <= 16  # half an e4m3 step at 448
