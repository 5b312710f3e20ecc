"""Fuzz properties of absorbed_bmm and mla_v_projection.

The harness, budgets and rules: tests/fuzz.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from fuzz import (
    BF16,
    F32,
    FUZZ,
    Placed,
    assert_gemm_close,
    assert_refused,
    devices,
    other_device,
    place,
    poison,
    randn,
    seeds,
)
from hypothesis import given
from hypothesis import strategies as st

from vllm_mla.ops import (
    AbsorbedBmmError,
    MXFP8Weight,
    absorbed_bmm,
    mla_v_projection,
)
from vllm_mla.ops import absorbed_matmul as ab
from vllm_mla.quant import mxfp8


@dataclass
class Absorbed:
    a: Placed
    weight: object
    parts: list[Placed]
    out: Placed | None
    dense: torch.Tensor  # float64


def _mx_weight(draw, w: torch.Tensor, axis: int, device):
    t = mxfp8.quantize(w, axis=axis)
    scale_dtype = draw(st.sampled_from(ab.SCALE_DTYPES))
    values = place(draw, t.values.to(device), last=False)
    scales = place(draw, t.scales.to(device).view(scale_dtype), last=False)
    return MXFP8Weight(values.view, scales.view), [values, scales], mxfp8.dequantize(t).double()


@st.composite
def absorbed_calls(draw, *, with_out=None):
    device = draw(devices)
    mx = draw(st.booleans())
    dtype = draw(st.sampled_from(ab.MXFP8_ACT_DTYPES if mx else ab.ACT_DTYPES))
    b, m = draw(st.integers(0, 3)), draw(st.integers(0, 5))
    seed = draw(seeds)
    scale = 0.05 * 2.0 ** draw(st.integers(-8, 8))
    if mx:
        along_k = draw(st.booleans())  # W_UV-like [B, K/32, N] or W_UK_T-like [B, K, N/32]
        blocks = st.sampled_from((0, 32, 64))
        k = draw(blocks) if along_k else draw(st.integers(0, 40))
        n = draw(st.integers(0, 40)) if along_k else draw(blocks)
        w = randn(seed, (b, k, n), scale=scale)
        weight, parts, dense = _mx_weight(draw, w, 1 if along_k else 2, device)
        dense = dense.to(device)
    else:
        k, n = draw(st.integers(0, 40)), draw(st.integers(0, 40))
        placed = place(draw, randn(seed, (b, k, n), dtype, device, scale), last=False)
        weight, parts, dense = placed.view, [placed], placed.view.double()
    a = place(draw, randn(seed + 1, (b, m, k), dtype, device), last=False)
    use_out = draw(st.booleans()) if with_out is None else with_out
    out = place(draw, poison((b, m, n), dtype, device), last=False) if use_out else None
    return Absorbed(a, weight, parts, out, dense)


@given(c=absorbed_calls())
@FUZZ
def test_absorbed_bmm_matches_the_fp32_reference(c):
    """Any strides (last dims included), B / M / K / N down to 0, bf16 / fp16 / fp32 with a
    dense weight or bf16 / fp32 with MXFP8 views (scales along K or N, uint8 or e8m0):
    the exact product within one rounding + fp32 summation order (test_absorbed_bmm); with
    ``out`` given it is returned and nothing outside it is written; inputs untouched."""
    got = absorbed_bmm(c.a.view, c.weight, c.out.view if c.out else None)
    if c.out is not None:
        assert got is c.out.view
        c.out.assert_outside_untouched()
    assert got.dtype == c.a.view.dtype and got.device == c.a.view.device
    assert_gemm_close(got, c.a.view, c.dense)
    for p in (c.a, *c.parts):
        p.assert_unchanged()


@st.composite
def v_projection_calls(draw):
    device = draw(devices)
    mx = draw(st.booleans())
    dtype = draw(st.sampled_from(ab.MXFP8_ACT_DTYPES if mx else ab.ACT_DTYPES))
    t, h = draw(st.integers(0, 4)), draw(st.integers(0, 3))
    lat = draw(st.sampled_from((0, 32, 64)) if mx else st.integers(0, 40))
    v = draw(st.integers(0, 40))
    seed = draw(seeds)
    if mx:  # W_UV [H, L, V] with scales [H, L/32, V]
        weight, parts, dense = _mx_weight(draw, randn(seed, (h, lat, v), scale=0.05), 1, device)
        dense = dense.to(device)
    else:
        placed = place(draw, randn(seed, (h, lat, v), dtype, device, 0.05), last=False)
        weight, parts, dense = placed.view, [placed], placed.view.double()
    x = place(draw, randn(seed + 1, (t, h, lat), dtype, device), last=False)
    out = place(draw, poison((t, h, v), dtype, device), last=False)
    return x, weight, parts, out, dense


@given(c=v_projection_calls())
@FUZZ
def test_mla_v_projection_matches_the_fp32_reference(c):
    """``out[t, h] = x[t, h] @ W_UV[h]`` for token-major strided x / out: the same bound."""
    x, weight, parts, out, dense = c
    assert mla_v_projection(x.view, weight, out.view) is out.view
    assert_gemm_close(out.view.transpose(0, 1), x.view.transpose(0, 1), dense)
    out.assert_outside_untouched()
    for p in (x, *parts):
        p.assert_unchanged()


ABSORBED_KINDS = (
    "a list",
    "a rank",
    "a float64",
    "a int32",
    "a device",
    "weight rank",
    "weight B",
    "weight K",
    "weight device",
    "weight dtype",
    "weight.values dtype",
    "weight.scales dtype",
    "weight.scales shape",
    "weight.scales device",
    "a float16 with MXFP8",
    "out shape",
    "out dtype",
    "out device",
    "x rank",
    "v out rank",
)


def _absorbed_bad(kind: str, c: Absorbed, device: str):
    """(call, name) for ``kind`` (None when it does not apply to this weight format)."""
    a, out = c.a.view, c.out.view if c.out is not None else None
    mx = isinstance(c.weight, MXFP8Weight)
    values, scales = (c.weight.values, c.weight.scales) if mx else (c.weight, None)
    other = other_device(device)

    def bmm(a=a, weight=c.weight, out=out):
        return lambda: absorbed_bmm(a, weight, out)

    def with_values(v, s=scales):
        return MXFP8Weight(v, s) if mx else v

    def grown(t, dim, by):
        shape = list(t.shape)
        shape[dim] += by
        return torch.empty(shape, dtype=t.dtype, device=t.device)

    b, m, k = a.shape
    n = values.shape[2]
    table = {
        "a list": (bmm(a=a.tolist()), "a must be"),
        "a rank": (bmm(a=a.flatten(0, 1)), "a must be"),
        "a float64": (bmm(a=a.double()), "a must be"),
        "a int32": (bmm(a=a.int()), "a must be"),
        "a device": (bmm(a=a.to(other)), "but a is on"),
        "weight rank": (bmm(weight=with_values(values.flatten(0, 1))), "weight must be 3-D"),
        "out shape": (bmm(out=grown(a.new_empty(b, m, n), 2, 1)), "out must be"),
        "out dtype": (bmm(out=a.new_empty(b, m, n, dtype=torch.float64)), "out must be"),
        "out device": (bmm(out=a.new_empty(b, m, n, device=other)), "out is on"),
        "x rank": (
            lambda: mla_v_projection(a.flatten(0, 1), c.weight, a.new_empty(m, b, n)),
            "x must be",
        ),
        "v out rank": (
            lambda: mla_v_projection(a.transpose(0, 1), c.weight, a.new_empty(m, n)),
            "out must be",
        ),
    }
    if mx:
        along_k = ab.scales_along_k(values, scales)
        q_b = mxfp8.quantize(torch.zeros(b + 1, k, n), axis=1 if along_k else 2)
        q_k = mxfp8.quantize(
            torch.zeros(b, k + 32 if along_k else k + 1, n), axis=1 if along_k else 2
        )
        table |= {
            "weight B": (
                bmm(weight=MXFP8Weight(q_b.values.to(device), q_b.scales.to(device))),
                "weight shape",
            ),
            "weight K": (
                bmm(weight=MXFP8Weight(q_k.values.to(device), q_k.scales.to(device))),
                "weight shape",
            ),
            "weight device": (bmm(weight=with_values(values.to(other))), "weight is on"),
            "weight.values dtype": (bmm(weight=with_values(values.to(BF16))), "weight.values"),
            "weight.scales dtype": (
                bmm(weight=MXFP8Weight(values, scales.float())),
                "weight.scales must",
            ),
            "weight.scales shape": (
                bmm(weight=MXFP8Weight(values, grown(scales, 0, 1))),
                "weight.scales shape",
            ),
            "weight.scales device": (
                bmm(weight=MXFP8Weight(values, scales.to(other))),
                "weight.scales is on",
            ),
            "a float16 with MXFP8": (bmm(a=a.half()), "takes a in"),
        }
    else:
        table |= {
            "weight B": (bmm(weight=grown(values, 0, 1)), "weight shape"),
            "weight K": (bmm(weight=grown(values, 1, 1)), "weight shape"),
            "weight device": (bmm(weight=values.to(other)), "weight is on"),
            "weight dtype": (
                bmm(weight=values.to(torch.float16 if values.dtype != torch.float16 else F32)),
                "weight dtype",
            ),
        }
    return table.get(kind)


@given(c=absorbed_calls(with_out=True), kind=st.sampled_from(ABSORBED_KINDS))
@FUZZ
def test_absorbed_bmm_refuses_bad_input_by_name(c, kind):
    """One operand made wrong: AbsorbedBmmError naming it; ``out`` is not written."""
    bad = _absorbed_bad(kind, c, c.a.view.device.type)
    if bad is None:  # a kind for the other weight format
        bad = _absorbed_bad("a float64", c, c.a.view.device.type)
    call, named = bad
    assert_refused(call, AbsorbedBmmError, named)
    c.out.assert_unchanged()
