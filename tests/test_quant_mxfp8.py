"""MXFP8 codec vs an independent numpy reference (frexp exponents, exhaustive e4m3 search)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_mla.quant import MXFP8Tensor, mxfp8

MODES = ("floor", "rceil")
NAN_CODE = 0x7F
FP32_MAX = float(np.finfo(np.float32).max)


# ---------------------------------------------------------------- independent reference


def _e4m3_positive_table() -> tuple[np.ndarray, np.ndarray]:
    """All finite non-negative float8_e4m3fn codes and their exact values."""
    codes = np.arange(0x7F)  # 0x7F itself is NaN
    exp, man = codes >> 3, codes & 7
    values = np.where(exp == 0, man * 2.0**-9, (8 + man) * 2.0 ** (exp - 10))
    return codes, values


E4M3_CODES, E4M3_VALUES = _e4m3_positive_table()


def e4m3_rne_reference(x: np.ndarray) -> np.ndarray:
    """uint8 codes of finite |x| <= 448 by exhaustive nearest search, ties to even mantissa.

    float64 distances are exact here: for |x| >= 2**-10, x (24 significant bits) and the table
    (lsb >= 2**-9) differ by < 2**9 with lsb >= 2**-34; smaller |x| are unambiguously nearer 0.
    """
    flat = np.asarray(x, dtype=np.float64).ravel()
    assert np.all(np.abs(flat) <= 448.0), "reference expects clamped input"
    out = np.empty(flat.shape, dtype=np.uint8)
    for lo in range(0, flat.size, 4096):
        chunk = flat[lo : lo + 4096]
        dist = np.abs(np.abs(chunk)[:, None] - E4M3_VALUES[None, :])
        nearest = dist == dist.min(axis=1, keepdims=True)
        rank = np.where(nearest, E4M3_CODES[None, :] & 1, 2)  # even mantissa LSB wins ties
        code = E4M3_CODES[rank.argmin(axis=1)]
        out[lo : lo + 4096] = code | (np.signbit(chunk).astype(np.int64) << 7)
    return out.reshape(np.shape(x))


def _biased_reference(amax: np.ndarray, mode: str) -> np.ndarray:
    if mode == "floor":
        _, e = np.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2) = e - 1
        exponent = e - 1 - 8
    else:
        s = (amax.astype(np.float32) / np.float32(448.0)).astype(np.float64)
        m, e = np.frexp(s)
        exponent = np.where(m == 0.5, e - 1, e)  # smallest power of two >= s
        # s underflows to 0 for amax < 448 * 2**-150: any power of two is >= 0, clamp to 0
        exponent = np.where(s == 0, -1000, exponent)
    biased = np.clip(exponent + 127, 0, 254)
    return np.where(amax == 0, 0, biased)


def mxfp8_reference(x: np.ndarray, axis: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(value codes, scale codes) of float32 ``x`` quantized with blocks of 32 on ``axis``."""
    moved = np.moveaxis(np.asarray(x, dtype=np.float32), axis, -1)
    blocks = moved.reshape(-1, 32).astype(np.float64)
    finite = np.isfinite(blocks).all(axis=1)
    amax = np.where(np.isfinite(blocks), np.abs(blocks), 0.0).max(axis=1)
    amax = np.where(finite, amax, 0.0)
    biased = _biased_reference(amax, mode)
    clean = np.where(finite[:, None], blocks, 0.0)
    scaled = np.clip(np.ldexp(clean, (127 - biased)[:, None]), -448.0, 448.0)
    codes = np.where(finite[:, None], e4m3_rne_reference(scaled), NAN_CODE).astype(np.uint8)
    biased = np.where(finite, biased, 255).astype(np.uint8)
    codes = np.moveaxis(codes.reshape(moved.shape), -1, axis)
    scales = np.moveaxis(biased.reshape((*moved.shape[:-1], -1)), -1, axis)
    return codes, scales


def assert_matches_reference(x: torch.Tensor, mode: str, axis: int = -1) -> MXFP8Tensor:
    q = mxfp8.quantize(x, axis=axis, scale_mode=mode)
    codes, scales = mxfp8_reference(x.float().numpy(), axis, mode)
    np.testing.assert_array_equal(q.scales.numpy(), scales)
    np.testing.assert_array_equal(q.values.view(torch.uint8).numpy(), codes)
    return q


def _blocks(amaxes: list[float], fill: float = 0.5) -> torch.Tensor:
    """One 32-element row per amax: [amax, fill * amax, alternating-sign ramp ...]."""
    rows = []
    for a in amaxes:
        ramp = [a * fill * (-1) ** i * (i + 1) / 32 for i in range(30)]
        rows.append([a, -fill * a, *ramp])
    return torch.tensor(rows, dtype=torch.float32)


def _pow2_edges(exponents: range, mantissas: tuple[float, ...]) -> list[float]:
    """m * 2**k and its float32 neighbours, for every in-range, nonzero combination."""
    out = []
    for k in exponents:
        for m in mantissas:
            if not -149 <= k <= 127:
                continue
            v = np.float32(math.ldexp(m, k))
            if v == 0 or not np.isfinite(v):
                continue
            out += [float(v), float(np.nextafter(v, np.float32(0))), float(np.nextafter(v, np.inf))]
    return [v for v in out if 0 < v <= FP32_MAX]


# ------------------------------------------------------------------------------- tests


def test_torch_e4m3_cast_is_round_to_nearest_even() -> None:
    """The library relies on torch's float32 -> float8_e4m3fn cast being RNE on [-448, 448]."""
    v = np.unique(np.concatenate([E4M3_VALUES, -E4M3_VALUES])).astype(np.float32)
    mids = ((v[1:].astype(np.float64) + v[:-1]) / 2).astype(np.float32)  # exact midpoints
    near = np.concatenate([np.nextafter(mids, np.float32(-np.inf)), mids])
    near = np.concatenate([near, np.nextafter(mids, np.float32(np.inf))])
    rng = np.random.default_rng(0)
    mags = np.exp2(rng.uniform(-30, math.log2(448), 20000)).astype(np.float32)
    rand = mags * rng.choice(np.array([-1, 1], dtype=np.float32), mags.size)
    sub = rng.integers(1, 2**23, 1000).astype(np.uint32).view(np.float32)  # fp32 subnormals
    x = np.concatenate([v, near, rand, sub, -sub, np.float32([0.0, -0.0])])
    x = x[np.abs(x) <= 448]
    got = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(got, e4m3_rne_reference(x))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dist", ["normal", "heavy"])
def test_random_across_magnitudes(mode: str, dist: str) -> None:
    rng = np.random.default_rng(1 if dist == "normal" else 2)
    shape = (64, 8 * 32)
    base = rng.standard_normal(shape) if dist == "normal" else rng.standard_t(1.5, shape)
    block_scale = 10.0 ** rng.uniform(-30, 30, (64, 8, 1))  # every block its own magnitude
    x = (base.reshape(64, 8, 32) * block_scale).reshape(shape).astype(np.float32)
    assert_matches_reference(torch.from_numpy(x), mode)


@pytest.mark.parametrize("mode", MODES)
def test_powers_of_two_and_neighbours(mode: str) -> None:
    amaxes = _pow2_edges(range(-160, 129), (1.0, 1.5, 1.75, 1.875))  # 1.75 * 2**k = 448 * 2**(k-8)
    assert_matches_reference(_blocks(amaxes), mode)
    assert_matches_reference(_blocks(amaxes, fill=1.0), mode)


@pytest.mark.parametrize("mode", MODES)
def test_at_and_above_448(mode: str) -> None:
    amaxes = [440.0, 448.0, 449.0, 464.0, 465.0, 480.0, 500.0, 511.0, 512.0, 1e4, FP32_MAX]
    q = assert_matches_reference(_blocks(amaxes, fill=0.99), mode)
    assert torch.all(q.values.float().abs() <= 448)


@pytest.mark.parametrize("mode", MODES)
def test_fp32_subnormal_blocks(mode: str) -> None:
    rng = np.random.default_rng(3)
    bits = rng.integers(1, 2**23, (16, 64), dtype=np.uint32)
    sub = bits.view(np.float32) * rng.choice(np.float32([-1, 1]), (16, 64))
    assert_matches_reference(torch.from_numpy(sub), mode)
    # Blocks whose rceil quotient amax / 448 is subnormal: s = 2**-127 must give biased 0.
    tiny = [448 * 2.0**k for k in range(-140, -120)] + [FP32_MAX * 2.0**-254]
    assert_matches_reference(_blocks(tiny), mode)


@pytest.mark.parametrize("mode", MODES)
def test_all_zero_blocks(mode: str) -> None:
    x = torch.zeros(2, 96)
    x[0, 32:64] = -0.0
    x[1, 64:] = torch.linspace(-3, 3, 32)
    q = assert_matches_reference(x, mode)
    assert q.scales[:, :2].tolist() == [[0, 0], [0, 0]]
    assert q.values.view(torch.uint8)[0, 32:64].tolist() == [0x80] * 32  # -0.0 keeps its sign
    assert torch.equal(mxfp8.dequantize(q)[:, :64], torch.zeros(2, 64))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_nonfinite_poisons_only_its_block(mode: str, poison: float) -> None:
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(4)) * 1e3
    x[1, 40] = poison
    q = assert_matches_reference(x, mode)
    assert q.scales[1, 1] == mxfp8.SCALE_NAN
    assert q.values.view(torch.uint8)[1, 32:64].tolist() == [NAN_CODE] * 32
    assert mxfp8.count_nan_blocks(q.scales) == 1
    deq = mxfp8.dequantize(q)
    assert torch.isnan(deq[1, 32:64]).all()
    deq[1, 32:64] = 0
    assert torch.isfinite(deq).all()


@pytest.mark.parametrize("mode", MODES)
def test_axes(mode: str) -> None:
    gen = torch.Generator().manual_seed(5)
    x2 = torch.randn(64, 5, generator=gen) * torch.logspace(-3, 3, 5)
    q0 = assert_matches_reference(x2, mode, axis=0)
    assert q0.axis == 0 and q0.scales.shape == (2, 5) and q0.values.shape == (64, 5)
    qt = mxfp8.quantize(x2.T.contiguous(), axis=-1, scale_mode=mode)
    assert torch.equal(q0.values.view(torch.uint8), qt.values.view(torch.uint8).T)
    assert mxfp8.quantize(x2.T, axis=-1, scale_mode=mode).axis == 1

    x3 = torch.randn(3, 96, 4, generator=gen)
    q1 = assert_matches_reference(x3, mode, axis=1)
    assert q1.scales.shape == (3, 3, 4)
    assert mxfp8.dequantize(q1).shape == x3.shape
    assert_matches_reference(x3.transpose(0, 2), mode, axis=-2)  # non-contiguous input


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_input(mode: str, dtype: torch.dtype) -> None:
    x = (torch.randn(8, 64, generator=torch.Generator().manual_seed(6)) * 300).to(dtype)
    assert_matches_reference(x, mode)


@pytest.mark.parametrize(
    ("amax", "mode", "biased", "code_value", "deq"),
    [
        (1.0, "floor", 119, 256.0, 1.0),  # floor(log2 1) - 8 = -8
        (1.0, "rceil", 119, 256.0, 1.0),  # 1/448 = 0.00223 -> 2**-8
        (448.0, "floor", 127, 448.0, 448.0),
        (448.0, "rceil", 127, 448.0, 448.0),  # s = 1 exactly
        (300.0, "floor", 127, 288.0, 288.0),  # 300 -> 288 (|12| < |20| to 320)
        (300.0, "rceil", 127, 288.0, 288.0),  # s = 0.67 -> 2**0
        (500.0, "floor", 127, 448.0, 448.0),  # saturates
        (500.0, "rceil", 128, 256.0, 512.0),  # s = 1.12 -> 2; 250 -> 256 (nearer than 240)
        (480.0, "floor", 127, 448.0, 448.0),  # modes differ: floor saturates ...
        (480.0, "rceil", 128, 240.0, 480.0),  # ... rceil represents 480 exactly
        (240.0, "floor", 126, 448.0, 224.0),  # floor(log2 240) = 7: 480 saturates to 448
        (240.0, "rceil", 127, 240.0, 240.0),  # s = 0.54 -> 2**0
        (2.0**-140, "rceil", 0, 0.0, 0.0),  # subnormal amax, clamped scale, flushes to 0
    ],
)
def test_hand_computed(amax: float, mode: str, biased: int, code_value: float, deq: float) -> None:
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    q = mxfp8.quantize(x, scale_mode=mode)
    assert q.scales.item() == biased
    assert q.values.float()[0, 0].item() == code_value
    assert mxfp8.dequantize(q)[0, 0].item() == deq


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_exact_for_representable_input(mode: str) -> None:
    rng = np.random.default_rng(7)
    n_blocks = 512
    codes = rng.integers(0, 256, (n_blocks, 32))
    codes[(codes & 0x7F) == 0x7F] = 0x00
    codes[:, 0] = rng.integers(0x78, 0x7F, n_blocks)  # one element in [256, 448] pins the scale
    values = np.where(codes & 0x80, -1.0, 1.0) * E4M3_VALUES[codes & 0x7F]
    k = rng.integers(-127, 120, (n_blocks, 1))
    x = torch.from_numpy(np.ldexp(values, k).astype(np.float32))
    q = mxfp8.quantize(x, scale_mode=mode)
    assert torch.equal(q.scales.long(), torch.from_numpy(k[:, 0] + 127)[:, None])
    assert torch.equal(mxfp8.dequantize(q), x)


def test_dequantize_matches_reference() -> None:
    rng = np.random.default_rng(8)
    codes = rng.integers(0, 256, (64, 64), dtype=np.uint8)
    scales = rng.integers(0, 256, (64, 2), dtype=np.uint8)
    t = MXFP8Tensor(torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scales), 1)
    mag = np.where((codes & 0x7F) == 0x7F, np.nan, E4M3_VALUES[np.minimum(codes & 0x7F, 0x7E)])
    value = np.where(codes & 0x80, -mag, mag)
    scale = np.where(scales == 255, np.nan, np.ldexp(1.0, scales.astype(np.int64) - 127))
    with np.errstate(over="ignore"):
        expected = (value * np.repeat(scale, 32, axis=1)).astype(np.float32)  # exact or inf
    np.testing.assert_array_equal(mxfp8.dequantize(t).numpy(), expected)
    bf16 = mxfp8.dequantize(t, torch.bfloat16)
    torch.testing.assert_close(bf16, mxfp8.dequantize(t).bfloat16(), rtol=0, atol=0, equal_nan=True)


def test_nan_scale_poisons_finite_codes() -> None:
    values = torch.ones(2, 64).to(torch.float8_e4m3fn)
    scales = torch.tensor([[127, 255], [255, 0]], dtype=torch.uint8)
    deq = mxfp8.dequantize(MXFP8Tensor(values, scales, 1))
    assert torch.isnan(deq).tolist() == [[False] * 32 + [True] * 32, [True] * 32 + [False] * 32]
    assert deq[0, 0] == 1.0 and deq[1, 63] == 2.0**-127
    assert mxfp8.count_nan_blocks(scales) == 2


def test_rceil_can_round_to_overflow_near_fp32_max() -> None:
    edge = np.float32(248 * 2.0**120)  # x / 2**120 = 248 ties to 256, decoding to 2**128
    x = torch.tensor([[FP32_MAX, edge, np.nextafter(edge, np.float32(0))] + [1.0] * 29])
    q = mxfp8.quantize(x, scale_mode="rceil")
    assert q.scales.item() == 247 and q.values.float()[0, :3].tolist() == [256, 256, 240]
    assert torch.isinf(mxfp8.dequantize(q)[0, :2]).all()
    assert torch.isfinite(mxfp8.dequantize(q)[0, 2:]).all()
    q = mxfp8.quantize(x, scale_mode="floor")
    assert q.scales.item() == 246 and torch.isfinite(mxfp8.dequantize(q)).all()


@pytest.mark.parametrize("shape", [(0, 64), (3, 0), (0, 0)])
def test_empty_input(shape: tuple[int, int]) -> None:
    q = mxfp8.quantize(torch.zeros(shape))
    assert q.values.shape == shape and q.scales.shape == (shape[0], shape[1] // 32)
    assert mxfp8.dequantize(q).shape == shape


def test_count_nan_blocks() -> None:
    assert mxfp8.count_nan_blocks(torch.tensor([0, 255, 254, 255], dtype=torch.uint8)) == 2
    assert mxfp8.count_nan_blocks(torch.zeros(0, dtype=torch.uint8)) == 0
    with pytest.raises(TypeError, match="uint8"):
        mxfp8.count_nan_blocks(torch.tensor([255]))


def test_narrow_and_nbytes() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(9))
    q = mxfp8.quantize(w)
    assert q.shape == (64, 128) and q.nbytes == 64 * 128 + 64 * 4
    part = q.narrow(0, 8, 16)
    assert part.values.data_ptr() == q.values[8].data_ptr()  # a view, not a copy
    assert part.scales.data_ptr() == q.scales[8].data_ptr()
    assert part.nbytes == 16 * 128 + 16 * 4
    assert torch.equal(mxfp8.dequantize(part), mxfp8.dequantize(q)[8:24])
    assert torch.equal(mxfp8.dequantize(q.narrow(-2, 60, 4)), mxfp8.dequantize(q)[60:])
    for dim in (1, -1):
        with pytest.raises(ValueError, match="block axis"):
            q.narrow(dim, 0, 32)

    q0 = mxfp8.quantize(w, axis=0)
    assert torch.equal(mxfp8.dequantize(q0.narrow(1, 3, 5)), mxfp8.dequantize(q0)[:, 3:8])


def test_quantize_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"\(4, 48\).*axis 1.*32"):
        mxfp8.quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match=r"\(48, 4\).*axis 0"):
        mxfp8.quantize(torch.zeros(48, 4), axis=0)
    with pytest.raises(ValueError, match="out of range"):
        mxfp8.quantize(torch.zeros(4, 32), axis=2)
    with pytest.raises(ValueError, match=r"floor.*rceil"):
        mxfp8.quantize(torch.zeros(4, 32), scale_mode="ceil")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="float64"):
        mxfp8.quantize(torch.zeros(4, 32, dtype=torch.float64))


def test_tensor_validation() -> None:
    values = torch.zeros(4, 64).to(torch.float8_e4m3fn)
    scales = torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        MXFP8Tensor(values.view(torch.uint8), scales, 1)
    with pytest.raises(TypeError, match="uint8"):
        MXFP8Tensor(values, scales.float(), 1)
    with pytest.raises(ValueError, match=r"expected \(4, 2\).*got \(4, 3\)"):
        MXFP8Tensor(values, torch.zeros(4, 3, dtype=torch.uint8), 1)
    with pytest.raises(ValueError, match="axis"):
        MXFP8Tensor(values, scales, -1)
    with pytest.raises(ValueError, match=r"scales: expected device cpu.*got meta"):
        MXFP8Tensor(values, scales.to("meta"), 1)  # dequantize would mix the devices
