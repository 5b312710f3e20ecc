"""Fuzz properties of mla_query_projection (the fused Triton kernel where gated in, else
the staged path).

The harness, budgets and rules: tests/fuzz.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from fuzz import (
    BF16,
    DEVICES,
    E4M3,
    F32,
    FUZZ,
    TRITON_DEVICES,
    Placed,
    assert_gemm_close,
    assert_refused,
    e4m3_step,
    needs_triton,
    other_device,
    place,
    poison,
    randn,
    resized,
    seeds,
    ulp,
    wider_last,
)
from hypothesis import given
from hypothesis import strategies as st

from vllm_mla.ops import (
    MXFP8Weight,
    mla_query_projection,
)
from vllm_mla.ops import query_projection as qp
from vllm_mla.quant import mxfp8


@dataclass
class Projection:
    inputs: list[Placed]
    q_nope: torch.Tensor
    weight: object
    q_pe: torch.Tensor
    out: Placed
    q_scale: torch.Tensor | None
    dense: torch.Tensor  # the weight's exact values, float64


@st.composite
def projection_calls(draw, fused: bool, min_m: int = 0, fmt: str | None = None):
    device = draw(st.sampled_from(TRITON_DEVICES if fused else DEVICES))
    fmt = fmt or draw(st.sampled_from(("bf16", "mxfp8")))
    if fused:  # inside can_fuse_query_projection's gate
        m, h = draw(st.integers(max(1, min_m), 4)), draw(st.integers(1, 4))
        p, lat, rope = draw(st.sampled_from(qp.FUSED_NOPE)), qp.FUSED_LATENT, qp.FUSED_ROPE
    else:  # outside it: the staged path, any sizes (L a multiple of 32 for MXFP8)
        m, h, p = draw(st.integers(min_m, 4)), draw(st.integers(0, 3)), draw(st.integers(0, 40))
        lat = draw(st.sampled_from((0, 32, 64)) if fmt == "mxfp8" else st.integers(0, 40))
        rope = draw(st.integers(0, 8))
    out_dtype = draw(st.sampled_from(qp.OUT_DTYPES))
    seed = draw(seeds)
    q_nope = randn(seed, (m, h, p), BF16, device)
    q_pe = randn(seed + 1, (m, h, rope), BF16, device)
    if draw(st.booleans()):  # split views of one q, as vLLM passes them
        q = place(draw, torch.cat([q_nope, q_pe], dim=-1))
        inputs, q_nope, q_pe = [q], q.view[..., :p], q.view[..., p:]
    else:
        parts = place(draw, q_nope), place(draw, q_pe)
        inputs, q_nope, q_pe = list(parts), parts[0].view, parts[1].view
    w = randn(seed + 2, (h, p, lat), scale=0.05)
    if fmt == "mxfp8":
        t = mxfp8.quantize(w, axis=-1)
        values, scales = place(draw, t.values.to(device)), place(draw, t.scales.to(device))
        inputs += [values, scales]
        pair = (values.view, scales.view)
        weight = MXFP8Weight(*pair) if draw(st.booleans()) else pair
        dense = mxfp8.dequantize(t).double().to(device)
    else:
        placed = place(draw, w.to(BF16).to(device))
        inputs.append(placed)
        weight, dense = placed.view, placed.view.double()
    out = place(draw, poison((m, h, lat + rope), out_dtype, device))
    q_scale = None
    if out_dtype == E4M3 or draw(st.booleans()):  # optional for bf16 out (then unused)
        shape = draw(st.sampled_from([(), (1,)]))
        value = draw(st.floats(0.01, 4.0))
        q_scale = torch.full(shape, value, dtype=F32, device=device)
    return Projection(inputs, q_nope, weight, q_pe, out, q_scale, dense)


def assert_projection_correct(out, q_nope, q_pe, dense, q_scale) -> None:
    """bf16 out: the latent part within one bf16 ulp (+ fp32 summation order) of the exact
    product, ``q_pe`` copied exactly; FP8 out: ``e4m3(clamp(bf16 / q_scale))`` of those,
    the latent part within one e4m3 step (+ the bf16 drift / q_scale), the ``q_pe`` part
    exact (test_query_projection)."""
    lat = dense.shape[2]
    exact = torch.einsum("mhp,hpl->mhl", q_nope.double(), dense)
    if out.dtype == BF16:
        assert_gemm_close(out[..., :lat].transpose(0, 1), q_nope.transpose(0, 1), dense)
        assert torch.equal(out[..., lat:], q_pe)
        return
    want = torch.cat([exact.to(BF16), q_pe], dim=-1).float() / q_scale.reshape(())
    want = want.clamp(-448, 448).to(E4M3)
    assert torch.equal(out[..., lat:].view(torch.uint8), want[..., lat:].view(torch.uint8))
    got, ref = out[..., :lat].double(), want[..., :lat].double()
    # The kernel's bf16 is within the gemm bound (K * 2**-24 * sum|q w|, one fp32 side) plus
    # one bf16 ulp of exact.to(BF16); / q_scale, then e4m3 rounds each side by <= half a step.
    slack = (
        q_nope.shape[-1]
        * 2.0**-24
        * torch.einsum("mhp,hpl->mhl", q_nope.double().abs(), dense.abs())
    )
    drift = (slack + ulp(2 * (exact.abs() + slack), BF16)) / q_scale.double().reshape(())
    step = e4m3_step(torch.maximum(got.abs(), ref.abs()))
    assert ((got - ref).abs() <= step + drift.to(got.device)).all()


def run_projection(c: Projection) -> None:
    got = mla_query_projection(c.q_nope, c.weight, c.q_pe, c.out.view, q_scale=c.q_scale)
    assert got is c.out.view
    assert_projection_correct(c.out.view, c.q_nope, c.q_pe, c.dense, c.q_scale)
    c.out.assert_outside_untouched()
    for p in c.inputs:
        p.assert_unchanged()


@needs_triton
@given(c=projection_calls(fused=True))
@FUZZ
def test_fused_query_projection_matches_the_reference(c):
    """Gated shapes (fused kernel): strided/offset q, weight (BF16 or MXFP8 views) and out,
    BF16 or FP8 out: the reference within the tolerance above, nothing written outside out."""
    run_projection(c)


@given(c=projection_calls(fused=False))
@FUZZ
def test_staged_query_projection_matches_the_reference(c):
    """Shapes outside the gate (M, H, P, L, R down to 0): the same contract on the staged path."""
    run_projection(c)


def _replace(c: Projection, **kw):
    args = {"q_nope": c.q_nope, "weight": c.weight, "q_pe": c.q_pe, "out": c.out.view}
    args["q_scale"] = c.q_scale
    args.update(kw)
    return args


def _pair(c: Projection):
    return tuple(c.weight) if isinstance(c.weight, tuple) else (c.weight, None)


def _projection_bad(kind: str, c: Projection, device: str):
    """(kwargs, exception, name) for one wrong argument of ``kind``."""
    values, scales = _pair(c)
    other = other_device(device)
    mx = scales is not None
    table = {
        "q_nope float32": ({"q_nope": c.q_nope.float()}, TypeError, "q_nope: expected dtype"),
        "q_nope list": ({"q_nope": c.q_nope.tolist()}, TypeError, "q_nope: expected a Tensor"),
        "q_nope rank": ({"q_nope": c.q_nope.flatten(0, 1)}, ValueError, "q_nope: expected 3-D"),
        "q_nope strided": ({"q_nope": wider_last(c.q_nope)}, ValueError, "q_nope: last dim"),
        "q_pe float16": ({"q_pe": c.q_pe.half()}, TypeError, "q_pe: expected dtype"),
        "q_pe M": ({"q_pe": resized(c.q_pe, 0)}, ValueError, "q_pe: expected [M="),
        "q_pe H": ({"q_pe": resized(c.q_pe, 1)}, ValueError, "q_pe: expected [M="),
        "q_pe device": ({"q_pe": c.q_pe.to(other)}, ValueError, "q_pe: expected device"),
        "out float16": ({"out": c.out.view.half()}, TypeError, "out: expected dtype"),
        "out shape": ({"out": resized(c.out.view, 2)}, ValueError, "out: expected shape"),
        "out strided": ({"out": wider_last(c.out.view)}, ValueError, "out: last dim"),
        "out device": ({"out": c.out.view.to(other)}, ValueError, "out: expected device"),
        "out fp8 no q_scale": (
            {"out": c.out.view.to(E4M3), "q_scale": None},
            ValueError,
            "q_scale: required",
        ),
        "q_scale float64": (
            {"q_scale": torch.ones((), dtype=torch.float64, device=device)},
            TypeError,
            "q_scale: expected a float32",
        ),
        "q_scale numel": (
            {"q_scale": torch.ones(2, device=device)},
            ValueError,
            "q_scale: expected 1 element",
        ),
        "q_scale device": (
            {"q_scale": torch.ones((), device=other)},
            ValueError,
            "q_scale: expected device",
        ),
        "weight H": (
            {"weight": resized(values, 0) if not mx else (resized(values, 0), scales)},
            ValueError,
            "weight: expected [H=",
        ),
        "weight P": (
            {"weight": resized(values, 1) if not mx else (resized(values, 1), scales)},
            ValueError,
            "weight: expected [H=",
        ),
        "weight device": (
            {"weight": values.to(other) if not mx else (values.to(other), scales)},
            ValueError,
            "weight: expected device",
        ),
    }
    if mx:
        table |= {
            "weight triple": ({"weight": (values, scales, scales)}, ValueError, "weight: an MXFP8"),
            "weight.values bf16": (
                {"weight": (values.to(BF16), scales)},
                TypeError,
                "weight.values: expected dtype",
            ),
            "weight.scales float32": (
                {"weight": (values, scales.float())},
                TypeError,
                "weight.scales: expected dtype",
            ),
            "weight.scales shape": (
                {"weight": (values, resized(scales, 2))},
                ValueError,
                "weight.scales: expected shape",
            ),
        }
    else:
        table |= {
            "weight float32": ({"weight": values.float()}, TypeError, "weight: expected dtype"),
            "weight rank": ({"weight": values.flatten(0, 1)}, ValueError, "weight: expected 3-D"),
        }
    if c.q_nope.shape[-1] < 2:  # a size-1 last dim may have any stride
        del table["q_nope strided"]
    if c.out.view.shape[-1] < 2:
        del table["out strided"]
    return table.get(kind)


PROJECTION_KINDS = (
    "q_nope float32",
    "q_nope list",
    "q_nope rank",
    "q_nope strided",
    "q_pe float16",
    "q_pe M",
    "q_pe H",
    "q_pe device",
    "out float16",
    "out shape",
    "out strided",
    "out device",
    "out fp8 no q_scale",
    "q_scale float64",
    "q_scale numel",
    "q_scale device",
    "weight H",
    "weight P",
    "weight device",
    "weight triple",
    "weight.values bf16",
    "weight.scales float32",
    "weight.scales shape",
    "weight float32",
    "weight rank",
)


@given(c=projection_calls(fused=False), kind=st.sampled_from(PROJECTION_KINDS))
@FUZZ
def test_query_projection_refuses_bad_input_by_name(c, kind):
    """One argument made wrong: TypeError / ValueError whose message starts with its name;
    ``out`` is not written."""
    device = c.q_nope.device.type
    bad = _projection_bad(kind, c, device)
    if bad is None:  # a kind for the other weight format: make it the bf16 dtype error
        bad = ({"q_nope": c.q_nope.float()}, TypeError, "q_nope: expected dtype")
    change, error, named = bad
    args = _replace(c, **change)
    assert_refused(lambda: mla_query_projection(**args), error, named)
    c.out.assert_unchanged()
