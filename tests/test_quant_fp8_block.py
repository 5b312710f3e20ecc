"""Block FP8 codec vs an independent numpy reference (float32 arithmetic, exhaustive e4m3)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vllm_mla.quant import FP8BlockTensor, fp8_block

# ---------------------------------------------------------------- independent reference

_CODES = np.arange(0x7F)  # finite non-negative float8_e4m3fn codes; 0x7F is NaN
_EXP, _MAN = _CODES >> 3, _CODES & 7
E4M3_VALUES = np.where(_EXP == 0, _MAN * 2.0**-9, (8 + _MAN) * 2.0 ** (_EXP - 10))


def e4m3_rne_reference(x: np.ndarray) -> np.ndarray:
    """uint8 codes of finite |x| <= 448 by exhaustive nearest search, ties to even mantissa
    (float64 distances are exact for float32 inputs in the range that can round to nonzero)."""
    flat = np.asarray(x, dtype=np.float64).ravel()
    out = np.empty(flat.shape, dtype=np.uint8)
    for lo in range(0, flat.size, 4096):
        chunk = flat[lo : lo + 4096]
        dist = np.abs(np.abs(chunk)[:, None] - E4M3_VALUES[None, :])
        rank = np.where(dist == dist.min(axis=1, keepdims=True), _CODES[None, :] & 1, 2)
        code = _CODES[rank.argmin(axis=1)]
        out[lo : lo + 4096] = code | (np.signbit(chunk).astype(np.int64) << 7)
    return out.reshape(np.shape(x))


def block_fp8_reference(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(value codes, float32 scale_inv) computed block by block in numpy float32."""
    w = np.asarray(w, dtype=np.float32)
    br, bc = block
    n_br, n_bc = math.ceil(w.shape[0] / br), math.ceil(w.shape[1] / bc)
    codes = np.empty(w.shape, dtype=np.uint8)
    scales = np.empty((n_br, n_bc), dtype=np.float32)
    for i in range(n_br):
        for j in range(n_bc):
            blk = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            scale = np.abs(blk).max() / np.float32(448.0)
            scale = np.float32(1.0) if scale == 0 else scale
            q = np.clip(blk / scale, np.float32(-448), np.float32(448))
            codes[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = e4m3_rne_reference(q)
            scales[i, j] = scale
    return codes, scales


def decode_reference(t: FP8BlockTensor) -> np.ndarray:
    codes = t.values.view(torch.uint8).numpy()
    mag = E4M3_VALUES[np.minimum(codes & 0x7F, 0x7E)]
    value = np.where(codes & 0x80, -mag, mag)
    br, bc = t.block
    scale = np.repeat(np.repeat(t.scale_inv.numpy().astype(np.float64), br, 0), bc, 1)
    # float64 holds the 4-bit x 24-bit product exactly, so one cast is the float32 rounding.
    return (value * scale[: codes.shape[0], : codes.shape[1]]).astype(np.float32)


def assert_matches_reference(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> None:
    t = fp8_block.quantize(w, block=block)
    codes, scales = block_fp8_reference(w.float().numpy(), block)
    np.testing.assert_array_equal(t.scale_inv.numpy(), scales)
    np.testing.assert_array_equal(t.values.view(torch.uint8).numpy(), codes)
    np.testing.assert_array_equal(fp8_block.dequantize(t).numpy(), decode_reference(t))


def _weights(shape: tuple[int, int], seed: int, spread: float = 6.0) -> torch.Tensor:
    """Gaussian rows with a log-uniform magnitude per 32 x 32 tile (blocks are not uniform)."""
    rng = np.random.default_rng(seed)
    tiles = 10.0 ** rng.uniform(-spread, spread, (math.ceil(shape[0] / 32), shape[1] // 16 + 1))
    mag = np.repeat(np.repeat(tiles, 32, 0), 16, 1)[: shape[0], : shape[1]]
    return torch.from_numpy((rng.standard_normal(shape) * mag).astype(np.float32))


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("shape", "block"), [((256, 384), (128, 128)), ((300, 200), (128, 128)), ((70, 50), (32, 16))]
)
def test_matches_reference(shape: tuple[int, int], block: tuple[int, int]) -> None:
    assert_matches_reference(_weights(shape, seed=shape[0]), block)


def test_heavy_tails_and_extreme_magnitudes() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_t(1.2, (256, 256)) * 10.0 ** rng.uniform(-35, 35, (256, 1))
    assert_matches_reference(torch.from_numpy(w.astype(np.float32)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_input(dtype: torch.dtype) -> None:
    assert_matches_reference(_weights((200, 160), seed=2, spread=2.0).to(dtype))


@pytest.mark.parametrize("k", [7, 63])
def test_ties_divide_by_scale_then_round_to_even(k: int) -> None:
    # amax 448 * k gives scale exactly k, and k * midpoint divides back to the exact midpoint:
    # every element is a tie that must go to the even code. For these k, x * fl(1 / k) misses
    # many of the ties, so the test also pins division over multiplication by the reciprocal.
    mids = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2
    w = torch.zeros(128, 128)
    w.view(-1)[: mids.size] = torch.from_numpy(k * mids).float()
    w[-1, -1] = 448.0 * k
    t = fp8_block.quantize(w)
    assert t.scale_inv.item() == k
    codes = t.values.view(torch.uint8).view(-1)[: mids.size].numpy()
    assert np.all(codes % 2 == 0)
    np.testing.assert_array_equal(codes, e4m3_rne_reference(mids))
    assert_matches_reference(w)


def test_partial_edge_blocks() -> None:
    w = _weights((300, 200), seed=3)
    t = fp8_block.quantize(w)
    assert t.scale_inv.shape == (3, 2) and t.values.shape == (300, 200)
    assert t.shape == (300, 200) and t.nbytes == 300 * 200 + 3 * 2 * 4
    assert t.scale_inv[2, 1] == w[256:, 128:].abs().max() / 448  # amax of the partial block only


def test_zero_and_underflowing_blocks_get_unit_scale() -> None:
    w = _weights((256, 256), seed=4)
    w[:128, :128] = 0.0
    w[128:, 128:] = 0.0
    w[200, 200] = 1e-45  # amax / 448 underflows float32 to 0
    t = fp8_block.quantize(w)
    assert t.scale_inv[0, 0] == 1.0 and t.scale_inv[1, 1] == 1.0
    assert torch.equal(fp8_block.dequantize(t)[:128, :128], torch.zeros(128, 128))
    assert torch.isfinite(fp8_block.dequantize(t)).all()
    assert_matches_reference(w)


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
def test_nonfinite_block_raises(poison: float) -> None:
    w = torch.zeros(300, 200)
    w[260, 10] = poison
    with pytest.raises(ValueError, match=r"block \(2, 0\)"):
        fp8_block.quantize(w)


def test_round_trip_error() -> None:
    w = torch.randn(512, 384, generator=torch.Generator().manual_seed(5))
    t = fp8_block.quantize(w)
    deq = fp8_block.dequantize(t)
    sqnr = 10 * torch.log10(w.pow(2).sum() / (deq - w).pow(2).sum())
    # e4m3 RNE, 3 mantissa bits: error uniform in half a step (2**-3 of the binade) has power
    # 2**-6 / 12 of x**2 at a binade's bottom: >= 28.9 dB (Gaussian blocks: ~31.5); 28 leaves
    # 0.9 dB for the subnormals. Deterministic: no summation order but the fp32 power sums.
    assert sqnr >= 28.0
    # 3 mantissa bits: |error| <= 2**-4 relative, or half the smallest subnormal 2**-10 * scale;
    # (1 + 2**-20): the fp32 division by the scale and the dequant multiply (2 x 2**-24).
    scale = t.scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = (2.0**-4 * w.abs()).maximum(2.0**-10 * scale) * (1 + 2.0**-20)
    assert torch.all((deq - w).abs() <= bound)


@pytest.mark.parametrize(
    ("shape", "rows"),
    [
        ((448, 256), slice(5, 300)),
        ((448, 256), slice(127, 129)),
        ((448, 256), slice(0, 448)),
        ((448, 256), slice(-10, None)),
        ((448, 256), slice(300, 300)),
        ((448, 256), slice(400, 9999)),
        ((300, 200), slice(250, 300)),
        ((300, 200), slice(1, 257)),
    ],
)
def test_dequantize_rows_matches_full(shape: tuple[int, int], rows: slice) -> None:
    t = fp8_block.quantize(_weights(shape, seed=6))
    part = fp8_block.dequantize(t, rows=rows)
    assert torch.equal(part, fp8_block.dequantize(t)[rows])
    assert torch.equal(
        fp8_block.dequantize(t, torch.bfloat16, rows=rows),
        fp8_block.dequantize(t)[rows].bfloat16(),
    )


def test_dequantize_rows_reads_only_needed_scale_rows() -> None:
    t = fp8_block.quantize(_weights((448, 256), seed=7))
    poisoned = t.scale_inv.clone()
    poisoned[[0, 3]] = math.nan  # rows 130..380 lie in block rows 1 and 2 only
    t2 = FP8BlockTensor(t.values, poisoned, t.block)
    part = fp8_block.dequantize(t2, rows=slice(130, 380))
    assert torch.equal(part, fp8_block.dequantize(t)[130:380])
    assert torch.isnan(fp8_block.dequantize(t2, rows=slice(127, 128))).all()
    assert torch.isnan(fp8_block.dequantize(t2, rows=slice(384, 385))).all()


class _LargestTensor(TorchDispatchMode):
    """Records the largest numel of any tensor an op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.numel = max(self.numel, leaf.numel())
        return out


def test_dequantize_rows_memory_is_proportional_to_rows() -> None:
    out_features, in_features = 1 << 18, 4  # one scale column, so scale rows dominate
    values = torch.ones(out_features, in_features).to(torch.float8_e4m3fn)
    t = FP8BlockTensor(values, torch.ones(out_features // 128, 1))
    with _LargestTensor() as mode:
        part = fp8_block.dequantize(t, rows=slice(1000, 1100))
    assert part.shape == (100, in_features)
    # Up to a block of slack per side (rows) and one block width (columns); the whole
    # tensor's expanded scales would be 2**18 entries.
    assert mode.numel <= (100 + 2 * 128) * 128


def test_dequantize_rows_errors() -> None:
    t = fp8_block.quantize(torch.ones(256, 128))
    with pytest.raises(ValueError, match="step 1"):
        fp8_block.dequantize(t, rows=slice(0, 256, 2))


def test_quantize_argument_errors() -> None:
    for bad in (torch.zeros(128), torch.zeros(2, 128, 128)):
        with pytest.raises(ValueError, match="2-D") as info:
            fp8_block.quantize(bad)
        assert str(tuple(bad.shape)) in str(info.value)
    with pytest.raises(TypeError, match="float64"):
        fp8_block.quantize(torch.zeros(128, 128, dtype=torch.float64))
    with pytest.raises(ValueError, match="block"):
        fp8_block.quantize(torch.zeros(128, 128), block=(0, 128))


def test_tensor_validation() -> None:
    values = torch.zeros(300, 200).to(torch.float8_e4m3fn)
    scale_inv = torch.ones(3, 2)
    assert FP8BlockTensor(values, scale_inv).block == (128, 128)
    with pytest.raises(TypeError, match=r"float8_e4m3fn.*uint8"):
        FP8BlockTensor(values.view(torch.uint8), scale_inv)
    with pytest.raises(TypeError, match=r"float32.*bfloat16"):
        FP8BlockTensor(values, scale_inv.bfloat16())
    with pytest.raises(ValueError, match=r"expected \(3, 2\).*got \(2, 2\)"):
        FP8BlockTensor(values, torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"2-D.*\(300,\)"):
        FP8BlockTensor(values[:, 0], torch.ones(3))
    with pytest.raises(ValueError, match=r"scale_inv: expected device cpu.*got meta"):
        FP8BlockTensor(values, scale_inv.to("meta"))  # dequantize would mix the devices
