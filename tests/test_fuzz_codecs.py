"""Fuzz properties of the MXFP8 and block-FP8 codecs.

The harness, budgets and rules: tests/fuzz.py.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from fuzz import (
    BF16,
    E4M3,
    F32,
    FUZZ,
    Placed,
    assert_refused,
    devices,
    layout,
    seeds,
)
from hypothesis import given
from hypothesis import strategies as st
from test_quant_fp8_block import block_fp8_reference  # the codec tests' numpy oracles
from test_quant_mxfp8 import mxfp8_reference

from vllm_mla.quant import FP8BlockTensor, MXFP8Tensor, fp8_block, mxfp8

SPECIALS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 448.0, 449.0, 2.0**-149, 3.4e38, 65504.0)
MAGNITUDES = ((-10, 10), (-150, -118), (-130, 128), (100, 128))


@st.composite
def codec_inputs(draw, shape, device):
    """Float32 values of ``shape``: normal times 2**e per element (e from a drawn range),
    with up to four special values (NaN, +-Inf, +-0, 448, subnormal, fp32 max ...) dropped in."""
    gen = torch.Generator().manual_seed(draw(seeds))
    lo, hi = draw(st.sampled_from(MAGNITUDES))
    exps = torch.randint(lo, hi + 1, shape, generator=gen).double()
    x = (torch.randn(shape, generator=gen).double() * torch.exp2(exps)).float()
    if x.numel():
        picks = st.tuples(st.integers(0, x.numel() - 1), st.sampled_from(SPECIALS))
        for pos, value in draw(st.lists(picks, max_size=4)):
            x.view(-1)[pos] = value
    return x.to(device)


@st.composite
def mx_shapes(draw):
    ndim = draw(st.integers(1, 3))
    axis = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(0, 3)) for _ in range(ndim)]
    shape[axis] = draw(st.sampled_from((0, 32, 64)))
    return tuple(shape), axis


@given(
    data=st.data(),
    dtype=st.sampled_from(mxfp8.INPUT_DTYPES),
    mode=st.sampled_from(("floor", "rceil")),
)
@FUZZ
def test_mxfp8_quantize_is_bit_exact(data, dtype, mode):
    """Any float32/bf16/fp16 view (rank 1-3, block axis size 0/32/64, specials included):
    codes and scales bit-equal to the numpy reference of test_quant_mxfp8; dequantize of the
    result equals the exact decode."""
    device = data.draw(devices)
    shape, axis = data.draw(mx_shapes())
    x = data.draw(codec_inputs(shape, device)).to(dtype)
    view = Placed(x, layout(data.draw, x.dim(), last=False)).view
    q = mxfp8.quantize(view, axis=axis, scale_mode=mode)
    assert q.axis == axis % len(shape) and q.values.shape == x.shape
    assert q.values.device == view.device and q.scales.device == view.device
    if x.numel():
        codes, scales = mxfp8_reference(x.float().cpu().numpy(), q.axis, mode)
        np.testing.assert_array_equal(q.scales.cpu().numpy(), scales)
        np.testing.assert_array_equal(q.values.view(torch.uint8).cpu().numpy(), codes)
    assert_mx_decode(q, F32)


def assert_mx_decode(t: MXFP8Tensor, dtype: torch.dtype) -> None:
    """dequantize(t, dtype) equals value * 2**(scale - 127) (NaN for code 0x7F / scale 255),
    computed in float64 and rounded once to float32, then cast to dtype."""
    codes = t.values.view(torch.uint8).cpu().numpy().astype(np.int64)
    mag_code = codes & 0x7F
    exp, man = mag_code >> 3, mag_code & 7
    mag = np.where(exp == 0, man * 2.0**-9, (8 + man) * 2.0 ** (exp - 10))
    mag = np.where(mag_code == 0x7F, np.nan, mag)
    value = np.where(codes & 0x80, -mag, mag)
    s = t.scales.cpu().numpy().astype(np.int64)
    scale = np.where(s == 255, np.nan, np.ldexp(1.0, s - 127))
    scale = np.repeat(scale, 32, axis=t.axis)
    with np.errstate(over="ignore", invalid="ignore"):
        want = torch.from_numpy((value * scale).astype(np.float32)).to(dtype)
    got = mxfp8.dequantize(t, dtype)
    assert got.dtype == dtype and got.device == t.values.device
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


@given(data=st.data(), dtype=st.sampled_from(mxfp8.INPUT_DTYPES))
@FUZZ
def test_mxfp8_dequantize_is_exact_on_any_codes(data, dtype):
    """Arbitrary value and scale codes (NaN codes, scale 0 and 255 included) in strided views:
    dequantize equals the exact decode of test_quant_mxfp8, in every output dtype."""
    device = data.draw(devices)
    shape, axis = data.draw(mx_shapes())
    axis %= len(shape)
    gen = torch.Generator().manual_seed(data.draw(seeds))
    scale_shape = mxfp8._scale_shape(shape, axis)
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    low, high = data.draw(st.sampled_from(((0, 256), (100, 150), (240, 256))))
    scales = torch.randint(low, high, scale_shape, generator=gen, dtype=torch.uint8)
    values = Placed(codes.to(device).view(E4M3), layout(data.draw, len(shape), last=False))
    scales = Placed(scales.to(device), layout(data.draw, len(shape), last=False))
    assert_mx_decode(MXFP8Tensor(values.view, scales.view, axis), dtype)
    values.assert_unchanged()
    scales.assert_unchanged()


MX_BAD = (
    "x float64",
    "x int32",
    "x axis range",
    "x axis size",
    "scale_mode",
    "values dtype",
    "scales dtype",
    "tensor axis",
    "tensor axis size",
    "scales shape",
    "decode_scales dtype",
    "count_nan_blocks dtype",
)


@given(kind=st.sampled_from(MX_BAD), device=devices, rows=st.integers(0, 3))
@FUZZ
def test_mxfp8_refuses_bad_input_by_name(kind, device, rows):
    """Wrong dtype, axis, block size, scale mode or scales shape: TypeError / ValueError
    naming the argument (quantize, MXFP8Tensor, decode_scales, count_nan_blocks)."""
    x = torch.zeros(rows, 64, device=device)
    values = torch.zeros(rows, 64, device=device).to(E4M3)
    scales = torch.zeros(rows, 2, dtype=torch.uint8, device=device)
    cases = {
        "x float64": (lambda: mxfp8.quantize(x.double()), TypeError, "x: expected"),
        "x int32": (lambda: mxfp8.quantize(x.int()), TypeError, "x: expected"),
        "x axis range": (lambda: mxfp8.quantize(x, axis=2), ValueError, "axis 2 out of range"),
        "x axis size": (lambda: mxfp8.quantize(x[:, :48]), ValueError, "on axis 1"),
        "scale_mode": (lambda: mxfp8.quantize(x, scale_mode="ceil"), ValueError, "scale_mode"),
        "values dtype": (
            lambda: MXFP8Tensor(values.view(torch.uint8), scales, 1),
            TypeError,
            "values: expected",
        ),
        "scales dtype": (lambda: MXFP8Tensor(values, scales.int(), 1), TypeError, "scales:"),
        "tensor axis": (lambda: MXFP8Tensor(values, scales, 2), ValueError, "axis must be"),
        "tensor axis size": (
            lambda: MXFP8Tensor(values[:, :40], scales, 1),
            ValueError,
            "on axis 1",
        ),
        "scales shape": (lambda: MXFP8Tensor(values, scales[:, :1], 1), ValueError, "scales"),
        "decode_scales dtype": (lambda: mxfp8.decode_scales(scales.int()), TypeError, "scales"),
        "count_nan_blocks dtype": (
            lambda: mxfp8.count_nan_blocks(scales.float()),
            TypeError,
            "scales",
        ),
    }
    call, error, named = cases[kind]
    assert_refused(call, error, named)


@st.composite
def fp8_block_cases(draw):
    device = draw(devices)
    rows, cols = draw(st.integers(0, 20)), draw(st.integers(0, 20))
    block = draw(
        st.one_of(st.just(fp8_block.BLOCK), st.tuples(st.integers(1, 8), st.integers(1, 8)))
    )
    dtype = draw(st.sampled_from(fp8_block.INPUT_DTYPES))
    x = draw(codec_inputs((rows, cols), device)).to(dtype)
    return Placed(x, layout(draw, 2, last=False)), block


@given(case=fp8_block_cases(), cut=st.tuples(st.integers(-22, 22), st.integers(-22, 22)))
@FUZZ
def test_fp8_block_quantize_is_bit_exact(case, cut):
    """Any 2-D float view and block shape (edge blocks partial): codes and scale_inv bit-equal
    to test_quant_fp8_block's numpy reference, dequantize exact, dequantize(rows=) equal to
    the slice of the whole; a block with NaN / Inf raises ValueError naming that block."""
    placed, block = case
    w = placed.view
    host = w.float().cpu()
    br, bc = block
    n_br, n_bc = -(-w.shape[0] // br), -(-w.shape[1] // bc)
    padded = torch.zeros(n_br * br, n_bc * bc)
    padded[: w.shape[0], : w.shape[1]] = host
    finite = torch.isfinite(padded.view(n_br, br, n_bc, bc)).all(dim=3).all(dim=1)
    if not finite.all():
        i, j = (int(v) for v in (~finite).nonzero()[0])
        assert_refused(lambda: fp8_block.quantize(w, block=block), ValueError, f"block ({i}, {j})")
        return
    t = fp8_block.quantize(w, block=block)
    placed.assert_unchanged()
    assert t.values.device == w.device and t.block == tuple(block)
    codes, scales = block_fp8_reference(host.numpy(), block)
    np.testing.assert_array_equal(t.scale_inv.cpu().numpy(), scales)
    np.testing.assert_array_equal(t.values.view(torch.uint8).cpu().numpy(), codes)
    full = fp8_block.dequantize(t)
    assert_fp8_block_decode(t, full)
    rows = slice(*cut)
    assert torch.equal(fp8_block.dequantize(t, rows=rows), full[rows])
    bf16 = fp8_block.dequantize(t, BF16, rows=rows)
    torch.testing.assert_close(bf16, full[rows].to(BF16), rtol=0, atol=0, equal_nan=True)


def assert_fp8_block_decode(t: FP8BlockTensor, got: torch.Tensor) -> None:
    """``got`` equals fl32(value * scale_inv[block]) computed exactly in float64."""
    codes = t.values.view(torch.uint8).cpu().numpy().astype(np.int64)
    mag_code = codes & 0x7F
    exp, man = mag_code >> 3, mag_code & 7
    mag = np.where(exp == 0, man * 2.0**-9, (8 + man) * 2.0 ** (exp - 10))
    mag = np.where(mag_code == 0x7F, np.nan, mag)
    value = np.where(codes & 0x80, -mag, mag)
    br, bc = t.block
    scale = t.scale_inv.cpu().numpy().astype(np.float64)
    scale = np.repeat(np.repeat(scale, br, 0), bc, 1)[: codes.shape[0], : codes.shape[1]]
    with np.errstate(over="ignore", invalid="ignore"):
        want = torch.from_numpy((value * scale).astype(np.float32))
    assert got.dtype == F32 and got.device == t.values.device
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


@given(data=st.data())
@FUZZ
def test_fp8_block_dequantize_is_exact_on_strided_containers(data):
    """A hand-built FP8BlockTensor (any codes, NaN included, positive scales from 2**-60 to
    2**60) whose values / scale_inv are strided views: dequantize is exact."""
    device = data.draw(devices)
    rows, cols = data.draw(st.integers(0, 20)), data.draw(st.integers(0, 20))
    block = data.draw(st.tuples(st.integers(1, 8), st.integers(1, 8)))
    gen = torch.Generator().manual_seed(data.draw(seeds))
    codes = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    shape = fp8_block._scale_shape((rows, cols), block)
    scale = torch.exp2(torch.randint(-60, 61, shape, generator=gen).float())
    scale = scale * (1 + torch.rand(shape, generator=gen))
    values = Placed(codes.to(device).view(E4M3), layout(data.draw, 2, last=False))
    scale_inv = Placed(scale.to(device), layout(data.draw, 2, last=False))
    t = FP8BlockTensor(values.view, scale_inv.view, block)
    assert_fp8_block_decode(t, fp8_block.dequantize(t))
    values.assert_unchanged()
    scale_inv.assert_unchanged()


FP8_BLOCK_BAD = (
    "w float64",
    "w int32",
    "w rank 1",
    "w rank 3",
    "block zero",
    "block triple",
    "values dtype",
    "scale_inv dtype",
    "values rank",
    "scale_inv shape",
    "rows step",
)


@given(kind=st.sampled_from(FP8_BLOCK_BAD), device=devices, rows=st.integers(1, 9))
@FUZZ
def test_fp8_block_refuses_bad_input_by_name(kind, device, rows):
    """Wrong dtype, rank, block, scale shape or a stepped ``rows``: TypeError / ValueError
    naming the argument."""
    w = torch.ones(rows, 5, device=device)
    t = fp8_block.quantize(w, block=(4, 4))
    cases = {
        "w float64": (lambda: fp8_block.quantize(w.double()), TypeError, "w: expected"),
        "w int32": (lambda: fp8_block.quantize(w.int()), TypeError, "w: expected"),
        "w rank 1": (lambda: fp8_block.quantize(w[0]), ValueError, "w: expected a 2-D"),
        "w rank 3": (lambda: fp8_block.quantize(w[None]), ValueError, "w: expected a 2-D"),
        "block zero": (lambda: fp8_block.quantize(w, block=(0, 4)), ValueError, "block:"),
        "block triple": (lambda: fp8_block.quantize(w, block=(4, 4, 4)), ValueError, "block:"),
        "values dtype": (
            lambda: FP8BlockTensor(t.values.view(torch.uint8), t.scale_inv, t.block),
            TypeError,
            "values: expected",
        ),
        "scale_inv dtype": (
            lambda: FP8BlockTensor(t.values, t.scale_inv.double(), t.block),
            TypeError,
            "scale_inv: expected",
        ),
        "values rank": (
            lambda: FP8BlockTensor(t.values[0], t.scale_inv, t.block),
            ValueError,
            "values: expected a 2-D",
        ),
        "scale_inv shape": (
            lambda: FP8BlockTensor(t.values, t.scale_inv[:, :1], t.block),
            ValueError,
            "scale_inv shape",
        ),
        "rows step": (lambda: fp8_block.dequantize(t, rows=slice(0, rows, 2)), ValueError, "rows:"),
    }
    call, error, named = cases[kind]
    assert_refused(call, error, named)
