"""Our models of vLLM's post-load layouts equal vLLM's own functions where they run on CPU."""

from __future__ import annotations

import pytest
import torch
import vllm_layers

from vllm_mla.quant import fp8_block, layouts


@pytest.mark.parametrize(("rows", "k"), [(640, 512), (130, 256), (7168, 512), (64, 128)])
def test_swizzle_equals_vllms_swizzle_mxfp8_scale(rows, k):
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import swizzle_mxfp8_scale

    gen = torch.Generator().manual_seed(rows)
    scales = torch.randint(0, 255, (rows, k // 32), generator=gen, dtype=torch.uint8)
    theirs = swizzle_mxfp8_scale(scales, M=rows, K=k).view(torch.uint8).reshape(-1)
    assert torch.equal(layouts.swizzle_128x4(scales), theirs)
    assert torch.equal(layouts.unswizzle_128x4(theirs, rows, k // 32), scales)


def test_requantize_ue8m0_equals_vllms_requant_weight_ue8m0_inplace():
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        requant_weight_ue8m0_inplace,
    )

    gen = torch.Generator().manual_seed(4)
    t = fp8_block.quantize(torch.randn(640, 512, generator=gen) * 0.05)
    weight, scale = t.values.clone(), t.scale_inv.clone()
    requant_weight_ue8m0_inplace(weight, scale, (128, 128))
    ours = fp8_block.requantize_ue8m0(t)
    assert torch.equal(ours.values.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(ours.scale_inv, scale)


def test_packed_ue8m0_equals_the_bit_by_bit_reference():
    scales = torch.pow(2.0, torch.randint(-20, 4, (5, 4)).float())
    reference = vllm_layers.pack_ue8m0_rows_reference(scales.unsqueeze(0), 640)[0]
    ours = layouts.pack_ue8m0_rows(scales, 640)
    assert ours.stride() == reference.stride() and torch.equal(ours, reference)
    back = vllm_layers.unpack_ue8m0_rows_reference(ours, 4)
    assert torch.equal(layouts.exponent_scales(layouts.unpack_ue8m0_rows(ours, 4)), back)
