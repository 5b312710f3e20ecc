"""Property-based fuzzing (Hypothesis) of every public op: shapes (0 and 1 where the op
allows them), strides (permuted, sliced, stepped views inside poisoned buffers), storage
offsets, dtypes and the device (CPU; CUDA too when ``torch.cuda.is_available()``).

Every example must either raise the op's typed error naming the argument at fault, or
return the op's reference within the tolerance the op's own tests use; an untyped crash
(a bare RuntimeError / IndexError / AttributeError from inside our code), a write outside
``out``, a changed input or a wrong answer fails the property.

Budgets (Hypothesis settings profiles, no deadline, no example database):

- ``ci`` (default): 20 examples per property, ``derandomize=True`` (the same examples on
  every run, so CI is deterministic). The whole file takes about 45 s on a 2-core CPU
  machine with the Triton kernels interpreted.
- ``full`` (``VLLM_MLA_FUZZ=full``): 500 examples per property (fewer where the input
  space is smaller), random, with shrinking and ``print_blob`` (replay a failure with
  ``@reproduce_failure``); about 8 minutes on the same machine.

No health check is suppressed: generation is cheap (tensor contents come from seeded
torch generators); only the interpreted kernels are slow, and the deadline is off.

Bugs this file found were fixed in the ops; the properties at the end of the file (after
"found by this file") are their tests, each with a comment saying what happened before the
fix: ``out`` with internal overlap (a stride-0 dim) in every op with an ``out``; ``out``
aliasing an input in absorbed_bmm and mla_query_projection; MXFP8 scales not a tensor or
on another device; an MXFP8 absorbed_bmm with N = 0; codec containers with parts on two
devices; unchecked inputs of the reference indexer; impl="triton" reading strided
lengths. No known gap is open. A new one is recorded as an ``xfail(strict=True)``
parameter naming the op, the input and what happens today, so that the fix turns it into
an XPASS failure and the mark is removed with it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from error_bounds import sparse_mla_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quant_fp8_block import block_fp8_reference  # the codec tests' numpy oracles
from test_quant_mxfp8 import mxfp8_reference

from vllm_mla import envs
from vllm_mla.ops import (
    AbsorbedBmmError,
    MXFP8Weight,
    absorbed_bmm,
    mla_query_projection,
    mla_v_projection,
    safe_mla_query_bmm,
)
from vllm_mla.ops import absorbed_matmul as ab
from vllm_mla.ops import query_projection as qp
from vllm_mla.ops import sparse_indexer as ix
from vllm_mla.ops import sparse_mla as sm
from vllm_mla.ops.sparse_indexer import IndexerError
from vllm_mla.ops.sparse_mla import (
    KV_FORMATS,
    SparseMLAError,
    SparseMLATypeError,
    sparse_mla_forward,
    sparse_mla_reference,
)
from vllm_mla.quant import FP8BlockTensor, MXFP8Tensor, fp8_block, mxfp8

# --- budgets ----------------------------------------------------------------------------------

_COMMON = {"deadline": None, "database": None}
settings.register_profile("ci", max_examples=20, derandomize=True, **_COMMON)
settings.register_profile("full", max_examples=500, print_blob=True, **_COMMON)
PROFILE = "full" if os.environ.get("VLLM_MLA_FUZZ") == "full" else "ci"
FUZZ = settings.get_profile(PROFILE)

# --- devices ----------------------------------------------------------------------------------

CUDA = torch.cuda.is_available()
DEVICES = ("cpu", "cuda") if CUDA else ("cpu",)
TRITON = qp.TRITON_AVAILABLE
# Where the Triton kernels run: CUDA, else the CPU interpreter (tests/conftest.py sets it).
TRITON_DEVICES = (
    ("cuda",) if CUDA and TRITON else (("cpu",) if TRITON and envs.triton_interpret() else ())
)
needs_triton = pytest.mark.skipif(not TRITON_DEVICES, reason="needs Triton (CUDA or interpreter)")


def other_device(device: str) -> str:
    """A device that differs from ``device`` (meta stands in for a second device on CPU)."""
    if device == "cuda":
        return "cpu"
    return "cuda" if CUDA else "meta"


BF16, F32 = torch.bfloat16, torch.float32
E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
seeds = st.integers(0, 2**31 - 1)
devices = st.sampled_from(DEVICES)


def randn(seed: int, shape, dtype=F32, device="cpu", scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


# --- views inside poisoned buffers ------------------------------------------------------------


def _fill(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A flat buffer of poison: NaN for floats (0xFF bytes for 1-byte types), 0 for ints
    (a valid row / length, so a stray read changes the answer)."""
    if dtype.itemsize == 1:
        return torch.full((n,), 0xFF, dtype=torch.uint8, device=device).view(dtype)
    if dtype.is_floating_point:
        return torch.full((n,), float("nan"), dtype=dtype, device=device)
    return torch.zeros(n, dtype=dtype, device=device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@dataclass(frozen=True)
class Layout:
    """Memory order of the dims, padding and step per dim, and a storage offset."""

    order: tuple[int, ...]
    pads: tuple[int, ...]
    steps: tuple[int, ...]
    offset: int


def layout(draw, ndim: int, *, last: bool = True) -> Layout:
    """A random layout; ``last`` keeps the last dim innermost with stride 1."""
    lead = ndim - 1 if last and ndim else ndim
    order = (*draw(st.permutations(range(lead))), *range(lead, ndim))
    pads = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    steps = [draw(st.integers(1, 2)) for _ in range(ndim)]
    if last and ndim:
        steps[-1] = 1
    return Layout(order, pads, tuple(steps), draw(st.integers(0, 3)))


class Placed:
    """``x``'s values in a view with a drawn layout inside a larger poisoned buffer; remembers
    the buffer's bytes to prove nothing outside the view (or, for inputs, nothing) changed."""

    def __init__(self, x: torch.Tensor, lay: Layout):
        shape = tuple(x.shape)
        mem = [(shape[d] + lay.pads[d]) * lay.steps[d] for d in lay.order]
        size = lay.offset + math.prod(mem)
        self.buffer = _fill(size, x.dtype, x.device)
        self.view = self._carve(self.buffer, shape, mem, lay)
        _bytes(self.view).copy_(_bytes(x))
        where = self._carve(torch.arange(size, device=x.device), shape, mem, lay)
        inside = torch.zeros(size, dtype=torch.bool, device=x.device)
        inside[where.reshape(-1)] = True
        self._outside = (~inside).repeat_interleave(x.element_size())
        self._before = self.buffer.view(torch.uint8).clone()

    @staticmethod
    def _carve(flat, shape, mem, lay: Layout) -> torch.Tensor:
        t = flat[lay.offset :].view(mem)
        t = t[tuple(slice(0, shape[d] * lay.steps[d], lay.steps[d]) for d in lay.order)]
        return t.permute(*[lay.order.index(d) for d in range(len(shape))])

    def assert_outside_untouched(self) -> None:
        now = self.buffer.view(torch.uint8)
        assert torch.equal(now[self._outside], self._before[self._outside]), "wrote outside"

    def assert_unchanged(self) -> None:
        assert torch.equal(self.buffer.view(torch.uint8), self._before), "an input changed"


def place(draw, x: torch.Tensor, *, last: bool = True) -> Placed:
    return Placed(x, layout(draw, x.dim(), last=last))


def poison(shape, dtype, device) -> torch.Tensor:
    return _fill(math.prod(shape), dtype, device).view(shape)


# --- tolerances (the ops' own tests) ----------------------------------------------------------

_MANTISSA = {BF16: 8, torch.float16: 11, F32: 24}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (float64), floored at the dtype's smallest subnormal."""
    _, exponent = torch.frexp(x.double().abs())
    spacing = torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - _MANTISSA[dtype])
    return spacing.clamp(min=torch.finfo(dtype).smallest_normal * 2.0 ** -_MANTISSA[dtype])


def assert_gemm_close(got: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` vs the exact ``a @ w`` (float64, batched): the fp32 summation-order bound
    ``K * 2**-23 * sum|a w|`` plus one ulp of ``got``'s dtype (bf16 / fp16), as
    tests/test_absorbed_bmm.py and tests/test_query_projection.py allow."""
    want = torch.matmul(a.double(), w.double())
    terms = torch.matmul(a.double().abs(), w.double().abs())
    # one fp32 sum of K terms, any order: <= K * 2**-24 of sum|terms|; 2**-23 leaves 2x
    tol = a.shape[-1] * 2.0**-23 * terms
    if got.dtype != F32:  # one rounding to bf16 / fp16: half an ulp; a whole one leaves 2x
        tol = tol + ulp(torch.maximum(got.double().abs(), want.abs()), got.dtype)
    assert got.shape == want.shape
    assert ((got.double() - want).abs() <= tol).all(), (got.double() - want).abs().max()


def e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """Spacing of float8_e4m3fn at |x| (3 mantissa bits, subnormal step 2**-9)."""
    _, exponent = torch.frexp(x.double().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 4).clamp(min=2.0**-9)


def assert_refused(call, errors, named: str):
    """``call()`` raises one of ``errors`` whose message names the argument (``named``);
    any other exception propagates and fails the property."""
    with pytest.raises(errors) as info:
        call()
    assert named in str(info.value), f"{named!r} not named in: {info.value}"


# =============================================================================================
# safe_mla_query_bmm


@st.composite
def bmm_calls(draw, min_size: int = 0):
    device = draw(devices)
    h, t = draw(st.integers(min_size, 4)), draw(st.integers(min_size, 4))
    q, lat = draw(st.integers(min_size, 40)), draw(st.integers(min_size, 40))
    seed = draw(seeds)
    query = place(draw, randn(seed, (h, t, q), BF16, device))
    weight = place(draw, randn(seed + 1, (h, q, lat), BF16, device))
    out = place(draw, poison((h, t, lat), BF16, device))
    return query, weight, out


@given(call=bmm_calls())
@FUZZ
def test_safe_mla_query_bmm_matches_the_fp32_product(call):
    """Any views with a contiguous last dim: ``out`` is returned, equals ``torch.bmm`` on
    the same views (CPU) and the fp32-accumulated product within one bf16 ulp; nothing is
    written outside ``out`` and the inputs are untouched."""
    query, weight, out = call
    assert safe_mla_query_bmm(query.view, weight.view, out.view) is out.view
    if out.view.device.type == "cpu":
        assert torch.equal(out.view, torch.bmm(query.view, weight.view))
    assert_gemm_close(out.view, query.view, weight.view)
    out.assert_outside_untouched()
    query.assert_unchanged()
    weight.assert_unchanged()


BMM_ARGS = ("query", "weight", "out")


def _wider_last(t: torch.Tensor) -> torch.Tensor:
    """Same shape, last dim strided (stride 2)."""
    return torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)[..., ::2]


def _resized(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A tensor like ``t`` with one more element along ``dim``."""
    shape = list(t.shape)
    shape[dim] += 1
    return torch.empty(shape, dtype=t.dtype, device=t.device)


BMM_BAD = {
    # kind: (exception, transform of the argument)
    "float32": (TypeError, lambda t: t.float()),
    "float16": (TypeError, lambda t: t.half()),
    "list": (TypeError, lambda t: t.tolist()),
    "rank 2": (ValueError, lambda t: t[0]),
    "rank 4": (ValueError, lambda t: t[None]),
    "size H": (ValueError, lambda t: _resized(t, 0)),
    "size 1": (ValueError, lambda t: _resized(t, 1)),
    "size 2": (ValueError, lambda t: _resized(t, 2)),
    "strided last dim": (ValueError, _wider_last),
    "device": (ValueError, lambda t: t.to(other_device(t.device.type))),
}


@given(
    call=bmm_calls(min_size=2), name=st.sampled_from(BMM_ARGS), kind=st.sampled_from(tuple(BMM_BAD))
)
@FUZZ
def test_safe_mla_query_bmm_refuses_bad_input_by_name(call, name, kind):
    """One argument made wrong (dtype, type, rank, a size, a strided last dim, its device):
    TypeError / ValueError naming that argument, and ``out`` is not written."""
    error, bad = BMM_BAD[kind]
    args = dict(zip(BMM_ARGS, (p.view for p in call), strict=True))
    args[name] = bad(args[name])
    assert_refused(lambda: safe_mla_query_bmm(**args), error, name)
    call[2].assert_unchanged()


@given(call=bmm_calls(min_size=1), into=st.sampled_from(("query", "weight")))
@FUZZ
def test_safe_mla_query_bmm_refuses_out_overlapping_an_input(call, into):
    """``out`` sharing memory with an input: ValueError ``out overlaps <input>``."""
    query, weight, out = (p.view for p in call)
    h, t, q = query.shape
    lat = weight.shape[2]
    if into == "query":  # [H, T, Q + L - 1]: column Q - 1 is in both views
        buf = torch.zeros(h, t, q + lat - 1, dtype=BF16, device=query.device)
        query, out = buf[..., :q], buf[..., q - 1 :]
    else:  # [H, Q + T - 1, L]: row Q - 1 is in both views
        buf = torch.zeros(h, q + t - 1, lat, dtype=BF16, device=query.device)
        weight, out = buf[:, :q], buf[:, q - 1 :]
    assert_refused(lambda: safe_mla_query_bmm(query, weight, out), ValueError, f"overlaps {into}")


# =============================================================================================
# mla_query_projection (fused Triton kernel where gated in, else the staged path)


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
        "q_nope strided": ({"q_nope": _wider_last(c.q_nope)}, ValueError, "q_nope: last dim"),
        "q_pe float16": ({"q_pe": c.q_pe.half()}, TypeError, "q_pe: expected dtype"),
        "q_pe M": ({"q_pe": _resized(c.q_pe, 0)}, ValueError, "q_pe: expected [M="),
        "q_pe H": ({"q_pe": _resized(c.q_pe, 1)}, ValueError, "q_pe: expected [M="),
        "q_pe device": ({"q_pe": c.q_pe.to(other)}, ValueError, "q_pe: expected device"),
        "out float16": ({"out": c.out.view.half()}, TypeError, "out: expected dtype"),
        "out shape": ({"out": _resized(c.out.view, 2)}, ValueError, "out: expected shape"),
        "out strided": ({"out": _wider_last(c.out.view)}, ValueError, "out: last dim"),
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
            {"weight": _resized(values, 0) if not mx else (_resized(values, 0), scales)},
            ValueError,
            "weight: expected [H=",
        ),
        "weight P": (
            {"weight": _resized(values, 1) if not mx else (_resized(values, 1), scales)},
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
                {"weight": (values, _resized(scales, 2))},
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


# =============================================================================================
# absorbed_bmm / mla_v_projection


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


# =============================================================================================
# sparse_mla_forward


@dataclass
class Sparse:
    q: object
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    cache: Placed
    indices: torch.Tensor
    lengths: torch.Tensor | None
    out: Placed | None
    lse: Placed | None
    return_lse: bool
    invalid: torch.Tensor | None
    scratch: torch.Tensor | None
    scale: float
    fmt: str
    inputs: list[Placed]


@st.composite
def sparse_calls(draw, impl: str, *, min_tokens: int = 0, lengths_step: int = 1):
    device = draw(st.sampled_from(TRITON_DEVICES if impl == "triton" else DEVICES))
    fmt = draw(st.sampled_from(KV_FORMATS))
    t, h, k = draw(st.integers(min_tokens, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 40))
    nb, bs = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    rows = nb * bs
    seed = draw(seeds)
    gen = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(rows, 512, generator=gen) * torch.rand(rows, 1, generator=gen) * 2
    k_pe = torch.randn(rows, 64, generator=gen)
    records = sm.pack_rows(kv_c, k_pe, fmt).view(nb, bs, -1).to(device)
    lay = layout(draw, 3)  # pages anywhere: poisoned neighbours turn stray reads into NaN
    if device == "cuda":  # keep the records' fp32 / bf16 fields aligned on a GPU
        lay = Layout(lay.order, lay.pads, lay.steps, 0)
    cache = Placed(records, lay)
    bad = st.sampled_from([rows, rows + 1, 1 << 20, -2, -(1 << 30), 2**31 - 1])
    entry = st.one_of(st.integers(0, rows - 1), st.integers(0, rows - 1), st.just(-1), bad)
    idx = torch.tensor(draw(st.lists(entry, min_size=t * k, max_size=t * k)), dtype=torch.int32)
    indices = place(draw, idx.view(t, k).to(device))
    inputs = [cache, indices]
    lengths = None
    if lengths_step > 1 or draw(st.booleans()):
        lens = torch.tensor(draw(st.lists(st.integers(-2, k + 3), min_size=t, max_size=t)))
        lay = layout(draw, 1)
        lay = Layout(lay.order, lay.pads, (lengths_step,), lay.offset)
        placed = Placed(lens.to(torch.int32).to(device), lay)
        inputs.append(placed)
        lengths = placed.view
    dtype = draw(st.sampled_from(sm.validate.Q_DTYPES))
    q_full = randn(seed + 1, (t, h, 576), dtype, device, 2.0)
    if draw(st.booleans()):
        q = place(draw, q_full)
        inputs.append(q)
        q_arg, q_nope, q_pe = q.view, q.view[..., :512], q.view[..., 512:]
    else:
        qn, qpe = place(draw, q_full[..., :512]), place(draw, q_full[..., 512:])
        inputs += [qn, qpe]
        q_arg, q_nope, q_pe = (qn.view, qpe.view), qn.view, qpe.view
    out = place(draw, poison((t, h, 512), dtype, device)) if draw(st.booleans()) else None
    lse = place(draw, poison((t, h), F32, device)) if draw(st.booleans()) else None
    invalid = torch.zeros(1, dtype=torch.int32, device=device) if draw(st.booleans()) else None
    scratch = None
    if impl == "triton" and t and draw(st.booleans()):
        need = sm.scratch_bytes(t, h, k, kv_format=fmt)
        scratch = torch.empty(max(need, 1), dtype=torch.uint8, device=device)
    scale = draw(st.floats(0.02, 0.1))
    return Sparse(
        q_arg,
        q_nope,
        q_pe,
        cache,
        indices.view,
        lengths,
        out,
        lse,
        draw(st.booleans()),
        invalid,
        scratch,
        scale,
        fmt,
        inputs,
    )


def sparse_oracle(c: Sparse):
    """Dense float64 softmax over each token's valid rows (independent of the op), and the
    number of live out-of-range indices (INDEX_RULE)."""
    cache = c.cache.view
    rows = cache.shape[0] * cache.shape[1]
    kv_c, k_pe = sm.unpack_rows(cache, torch.arange(rows, device=cache.device), c.fmt)
    kv_c, k_pe = kv_c.double().cpu(), k_pe.double().cpu()
    t, h = c.q_nope.shape[:2]
    out = torch.zeros(t, h, 512, dtype=torch.float64)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float64)
    invalid = 0
    idx = c.indices.cpu().tolist()
    for i in range(t):
        live = len(idx[i]) if c.lengths is None else max(0, min(int(c.lengths[i]), len(idx[i])))
        sel = [r for r in idx[i][:live] if 0 <= r < rows]
        invalid += sum(1 for r in idx[i][:live] if not -1 <= r < rows)
        if sel:
            s = c.q_nope[i].double().cpu() @ kv_c[sel].T + c.q_pe[i].double().cpu() @ k_pe[sel].T
            s = s * c.scale
            lse[i] = torch.logsumexp(s, dim=-1)
            out[i] = torch.softmax(s, dim=-1) @ kv_c[sel]
    return out, lse, invalid


def clean(c: Sparse) -> torch.Tensor:
    """Indices with every out-of-range entry replaced by -1 (what INDEX_RULE reads)."""
    rows = c.cache.view.shape[0] * c.cache.view.shape[1]
    idx = c.indices.contiguous()
    return torch.where((idx >= -1) & (idx < rows), idx, -1)


def assert_sparse_matches(out, lse, ref, ref_lse, bound, *, gpu: bool) -> None:
    """test_sparse_mla's check: out within ``bound`` (two fp32 orders, error_bounds) plus
    one bf16 ulp (each side rounds once), lse within its bound (interpreter / CPU), empty
    rows exactly (0, -inf); on a GPU OUT_REL_ERR / LSE_ABS_ERR (bf16 operands there)."""
    out_tol, lse_tol = bound
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.float().isnan().any()
    got, want = out.double().cpu(), ref.double().cpu()
    if gpu:
        # + 1e-6 absolute: a (near-)empty reference, whose ~0 norm leaves no relative room
        assert (got - want).norm() <= sm.OUT_REL_ERR * want.norm() + 1e-6
    else:
        tol = out_tol + (
            ulp(torch.maximum(got.abs(), want.abs()), BF16) if out.dtype == BF16 else 0
        )
        assert ((got - want).abs() <= tol).all(), ((got - want).abs() - tol).max()
    if lse is not None:
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        finite = torch.isfinite(ref_lse).cpu()
        err = sm.LSE_ABS_ERR if gpu else lse_tol[finite]
        assert ((lse.cpu()[finite].double() - ref_lse.cpu()[finite]).abs() <= err).all()
        assert (out.float()[~finite.to(out.device)] == 0).all()


def run_sparse(c: Sparse, impl: str) -> None:
    got_out, got_lse = sparse_mla_forward(
        c.q,
        c.cache.view,
        c.indices,
        c.scale,
        kv_format=c.fmt,
        lengths=c.lengths,
        out=c.out.view if c.out else None,
        scratch=c.scratch,
        return_lse=c.return_lse,
        lse=c.lse.view if c.lse else None,
        invalid=c.invalid,
        impl=impl,
    )
    if c.out is not None:
        assert got_out is c.out.view
        c.out.assert_outside_untouched()
    if c.lse is not None:
        assert got_lse is c.lse.view
        c.lse.assert_outside_untouched()
    else:
        assert (got_lse is not None) == c.return_lse
    lengths = c.lengths.contiguous() if c.lengths is not None else None
    q = (c.q_nope.contiguous(), c.q_pe.contiguous())
    cache = c.cache.view.contiguous()
    ref, ref_lse = sparse_mla_reference(
        q, cache, clean(c), c.scale, kv_format=c.fmt, lengths=lengths
    )
    gpu = c.q_nope.is_cuda and impl != "reference"
    # one fp32 evaluation vs the exact result (sides=1); two orders are twice that
    out_tol, lse_tol = sparse_mla_bound(q, cache, clean(c), c.scale, c.fmt, lengths, sides=1)
    assert_sparse_matches(got_out, got_lse, ref, ref_lse, (2 * out_tol, 2 * lse_tol), gpu=gpu)
    oracle, oracle_lse, invalid = sparse_oracle(c)
    if c.invalid is not None:
        assert int(c.invalid) == invalid
    # the reference itself against the float64 dense softmax: one fp32 side, one bf16 rounding
    tol = out_tol + (ulp(oracle, BF16) if ref.dtype == BF16 else 0)
    assert ((ref.double().cpu() - oracle).abs() <= tol).all()
    finite = torch.isfinite(oracle_lse)
    assert torch.equal(torch.isfinite(ref_lse.cpu()), finite)
    assert ((ref_lse.double().cpu()[finite] - oracle_lse[finite]).abs() <= lse_tol[finite]).all()
    for p in c.inputs:
        p.assert_unchanged()


@given(c=sparse_calls("reference"))
@FUZZ
def test_sparse_mla_reference_impl_matches_the_dense_softmax(c):
    """impl="reference", any views / offsets / dtypes, T down to 0, K past one chunk,
    out-of-range indices (empty, counted by ``invalid``), lengths past K or negative:
    equal to the reference on contiguous copies with the bad indices cleared, which equals
    a float64 dense softmax; nothing written outside out / lse; inputs untouched."""
    run_sparse(c, "reference")


@needs_triton
@given(c=sparse_calls("triton"))
@FUZZ
def test_sparse_mla_triton_impl_matches_the_reference(c):
    """impl="triton" (interpreted on CPU): the same property, with caller scratch or without."""
    run_sparse(c, "triton")


SPARSE_KINDS = (
    "q float16",
    "q width",
    "q no heads",
    "q one-tuple",
    "q object",
    "q_pe heads",
    "q_pe dtype",
    "q_nope strided",
    "kv_format name",
    "kv_cache dtype",
    "kv_cache width",
    "kv_cache strided",
    "kv_cache empty",
    "kv_cache object",
    "kv_cache device",
    "indices int64",
    "indices tokens",
    "indices no k",
    "indices strided",
    "indices device",
    "lengths int64",
    "lengths shape",
    "lengths device",
    "out shape",
    "out dtype",
    "out strided",
    "out device",
    "lse dtype",
    "lse shape",
    "lse strided",
    "invalid int64",
    "invalid shape",
    "softmax_scale tensor",
    "impl name",
    "scratch dtype",
    "scratch small",
    "scratch misaligned",
    "scratch 2-D",
)


def _sparse_bad(kind: str, c: Sparse):
    """(kwargs changes, impl, exception, name) for one wrong argument."""
    t, h = c.q_nope.shape[:2]
    k = c.indices.shape[1]
    dev = c.q_nope.device
    other = other_device(dev.type)
    cache = c.cache.view
    q = torch.cat([c.q_nope, c.q_pe], dim=-1)
    err, terr = SparseMLAError, SparseMLATypeError
    zeros = torch.zeros
    table = {
        "q float16": ({"q": q.half()}, terr, "q: expected dtype"),
        "q width": ({"q": q[..., :575]}, err, "q: expected shape"),
        "q no heads": ({"q": q[:, :0]}, err, "H >= 1"),
        "q one-tuple": ({"q": (c.q_nope,)}, err, "q: expected a (q_nope, q_pe)"),
        "q object": ({"q": object()}, terr, "q: expected a Tensor"),
        "q_pe heads": ({"q": (c.q_nope, _resized(c.q_pe, 1))}, err, "q_pe: expected shape"),
        "q_pe dtype": (
            {"q": (c.q_nope, c.q_pe.to(F32 if c.q_pe.dtype == BF16 else BF16))},
            terr,
            "q_pe: expected dtype",
        ),
        "q_nope strided": ({"q": (_wider_last(c.q_nope), c.q_pe)}, err, "q_nope: last dim"),
        "kv_format name": ({"kv_format": "fp8"}, err, "kv_format: expected one of"),
        "kv_cache dtype": ({"kv_cache": cache.view(torch.int8)}, terr, "kv_cache: format"),
        "kv_cache width": ({"kv_cache": cache[..., 1:]}, err, "kv_cache: format"),
        "kv_cache strided": ({"kv_cache": _wider_last(cache)}, err, "kv_cache: last dim"),
        "kv_cache empty": ({"kv_cache": cache[:0]}, err, "kv_cache: expected a non-empty"),
        "kv_cache object": ({"kv_cache": object()}, terr, "kv_cache: expected a Tensor"),
        "kv_cache device": ({"kv_cache": cache.to(other)}, err, "kv_cache: expected device"),
        "indices int64": ({"indices": c.indices.long()}, terr, "indices: expected dtype"),
        "indices tokens": ({"indices": _resized(c.indices, 0)}, err, "indices: expected shape"),
        "indices no k": ({"indices": c.indices[:, :0]}, err, "indices: expected [T="),
        "indices device": ({"indices": c.indices.to(other)}, err, "indices: expected device"),
        "lengths int64": ({"lengths": zeros(t, dtype=torch.int64)}, terr, "lengths: expected"),
        "lengths shape": ({"lengths": zeros(t + 1, dtype=torch.int32)}, err, "lengths: expected"),
        "lengths device": (
            {"lengths": zeros(t, dtype=torch.int32, device=other)},
            err,
            "lengths: expected device",
        ),
        "out shape": ({"out": zeros(t, h, 576, dtype=q.dtype)}, err, "out: expected shape"),
        "out dtype": ({"out": zeros(t, h, 512, dtype=torch.float16)}, terr, "out: expected dtype"),
        "out strided": (
            {"out": _wider_last(zeros(t, h, 512, dtype=q.dtype))},
            err,
            "out: last dim",
        ),
        "out device": ({"out": zeros(t, h, 512, dtype=q.dtype, device=other)}, err, "out: exp"),
        "lse dtype": ({"lse": zeros(t, h, dtype=BF16)}, terr, "lse: expected dtype"),
        "lse shape": ({"lse": zeros(t, h + 1)}, err, "lse: expected shape"),
        "invalid int64": ({"invalid": zeros(1, dtype=torch.int64)}, terr, "invalid: expected"),
        "invalid shape": ({"invalid": zeros(2, dtype=torch.int32)}, err, "invalid: expected"),
        "softmax_scale tensor": ({"softmax_scale": torch.tensor(1.0)}, terr, "softmax_scale"),
        "impl name": ({"impl": "cuda"}, err, "impl: expected one of"),
    }
    if k >= 2:
        table["indices strided"] = ({"indices": _wider_last(c.indices)}, err, "indices: last")
    if h >= 2:
        table["lse strided"] = ({"lse": _wider_last(zeros(t, h))}, err, "lse: last dim")
    impl = "reference"
    if kind.startswith("scratch") and TRITON_DEVICES and dev.type in TRITON_DEVICES:
        impl = "triton"
        from vllm_mla.ops.sparse_mla import triton_kernels as kernels

        need = kernels.split_plan(t, h, k).layout()[2]
        buf = torch.empty(need + 32, dtype=torch.uint8, device=dev)
        table |= {
            "scratch dtype": ({"scratch": buf.float()}, terr, "scratch: expected dtype"),
            "scratch 2-D": ({"scratch": buf[None]}, err, "scratch: expected a contiguous 1-D"),
            "scratch misaligned": ({"scratch": buf[1:]}, err, "scratch: expected a 16-byte"),
        }
        if need:
            table["scratch small"] = ({"scratch": buf[: need - 1]}, err, "scratch: expected >=")
    if kind not in table:  # not applicable to this call: the dtype error stands in
        kind = "q float16"
    return (*table[kind][:1], impl, *table[kind][1:])


@given(c=sparse_calls("reference", min_tokens=1), kind=st.sampled_from(SPARSE_KINDS))
@FUZZ
def test_sparse_mla_refuses_bad_input_by_name(c, kind):
    """One argument made wrong: SparseMLAError / SparseMLATypeError naming it (scratch ones
    with impl="triton"); ``out`` is not written."""
    change, impl, error, named = _sparse_bad(kind, c)
    args = {
        "q": c.q,
        "kv_cache": c.cache.view,
        "indices": c.indices,
        "softmax_scale": c.scale,
        "kv_format": c.fmt,
        "lengths": c.lengths,
        "out": c.out.view if c.out else None,
        "lse": c.lse.view if c.lse else None,
        "invalid": c.invalid,
        "impl": impl,
    }
    args.update(change)
    assert_refused(lambda: sparse_mla_forward(**args), error, named)
    if c.out is not None:
        c.out.assert_unchanged()


# =============================================================================================
# codecs: MXFP8 and block FP8

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


# =============================================================================================
# the DSA indexer oracle (vllm_mla.ops.sparse_indexer)


def index_cache(draw, device, nb: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed ``[nb, bs, 132]`` cache whose pages interleave with other layers' (dim-0
    stride a multiple of the page); returns (cache, the whole buffer)."""
    layers = draw(st.integers(1, 2))
    buf = torch.zeros(nb, layers, bs, ix.RECORD_BYTES, dtype=torch.uint8, device=device)
    return buf[:, draw(st.integers(0, layers - 1))], buf


@given(data=st.data())
@FUZZ
def test_indexer_insert_keys_writes_exactly_the_named_slots(data):
    """Keys (any float dtype, strided, some slots negative) land at their physical slots
    as quantize_rows of the row (values and scale bit-exact, read back by read_keys);
    every other byte of the cache buffer stays zero."""
    device = data.draw(devices)
    nb, bs = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    cache, buf = index_cache(data.draw, device, nb, bs)
    rows = nb * bs
    chosen = data.draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows))
    slots = chosen + data.draw(st.lists(st.integers(-5, -1), max_size=3))
    slots = data.draw(st.permutations(slots))
    dtype = data.draw(st.sampled_from((F32, BF16, torch.float16)))
    scale = 10.0 ** data.draw(st.integers(-6, 3))
    k = randn(data.draw(seeds), (len(slots), 128), dtype, device, scale)
    k = Placed(k, layout(data.draw, 2, last=False))
    ue8m0 = data.draw(st.booleans())
    ix.insert_keys(cache, k.view, torch.tensor(slots, dtype=torch.long, device=device), ue8m0=ue8m0)
    k.assert_unchanged()
    keep = [i for i, s in enumerate(slots) if s >= 0]
    if keep:
        values, scales = ix.quantize_rows(k.view[keep].contiguous(), ue8m0=ue8m0)
        got_v, got_s = ix.read_keys(cache, torch.tensor([slots[i] for i in keep], device=device))
        assert torch.equal(got_v.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(got_s, scales)
    rest = torch.tensor(sorted(set(range(rows)) - set(chosen)), dtype=torch.long, device=device)
    got_v, got_s = ix.read_keys(cache, rest)
    assert not got_v.view(torch.uint8).any() and not got_s.any()
    written = int(buf.count_nonzero())
    assert written <= len(keep) * ix.RECORD_BYTES


@given(data=st.data())
@FUZZ
def test_indexer_index_topk_selects_the_top_logits(data):
    """Any T (0 included), heads, block tables over interleaved pages, lengths from -1 to the
    table's capacity and K from 0 past the context: the K largest logits of each token's
    causal positions, ties to the lower position, descending, -1 padded
    (the direct computation of test_sparse_indexer)."""
    device = data.draw(devices)
    nb, bs = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    cache, _ = index_cache(data.draw, device, nb, bs)
    seed = data.draw(seeds)
    keys = randn(seed, (nb * bs, 128), device=device)
    ix.insert_keys(cache, keys, torch.arange(nb * bs, device=device))
    t, h, width = (
        data.draw(st.integers(0, 3)),
        data.draw(st.integers(1, 4)),
        data.draw(st.integers(1, 3)),
    )
    pages = st.lists(st.integers(0, nb - 1), min_size=width, max_size=width)
    tables = torch.tensor(data.draw(st.lists(pages, min_size=t, max_size=t)), dtype=torch.int32)
    tables = tables.view(t, width).to(device)
    lengths = data.draw(st.lists(st.integers(-1, width * bs), min_size=t, max_size=t))
    lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
    topk = data.draw(st.integers(0, width * bs + 2))
    q = Placed(randn(seed + 1, (t, h, 128), device=device), layout(data.draw, 3, last=False))
    w = randn(seed + 2, (t, h), device=device)
    got = ix.index_topk(q.view, w, cache, tables, lengths, topk)
    assert got.shape == (t, topk) and got.dtype == torch.int32
    for i in range(t):
        n = max(0, int(lengths[i]))
        want = []
        if n:
            keys, key_scales = ix.read_keys(cache, ix.request_rows(tables[i], n, bs))
            s = ix.logits(q.view[i : i + 1], w[i : i + 1], keys, key_scales)[0].tolist()
            want = sorted(range(n), key=lambda j: (-s[j], j))[:topk]
        assert got[i].tolist() == want + [-1] * (topk - len(want))


INDEXER_BAD = (
    "cache dtype",
    "cache width",
    "cache rank",
    "cache pages strided",
    "k width",
    "k rows",
    "q rank",
    "q width",
    "weights shape",
    "lengths shape",
    "topk cache",
)


@given(kind=st.sampled_from(INDEXER_BAD), device=devices, t=st.integers(1, 3))
@FUZZ
def test_indexer_refuses_bad_input_by_name(kind, device, t):
    """A wrong cache layout, key / query / weights / lengths shape: IndexerError naming it."""
    cache = torch.zeros(2, 4, ix.RECORD_BYTES, dtype=torch.uint8, device=device)
    k, slots = torch.zeros(t, 128, device=device), torch.arange(t, device=device)
    q, w = torch.zeros(t, 2, 128, device=device), torch.zeros(t, 2, device=device)
    tables = torch.zeros(t, 2, dtype=torch.int32, device=device)
    lengths = torch.ones(t, dtype=torch.int32, device=device)
    wide = torch.zeros(2, 4, 2 * ix.RECORD_BYTES, dtype=torch.uint8, device=device)

    def insert(c=cache, k=k):
        return lambda: ix.insert_keys(c, k, slots)

    def topk(q=q, w=w, c=cache, lengths=lengths):
        return lambda: ix.index_topk(q, w, c, tables, lengths, 2)

    cases = {
        "cache dtype": (insert(c=cache.float()), "index-key cache"),
        "cache width": (insert(c=cache[..., :128]), "index-key cache"),
        "cache rank": (insert(c=cache[0]), "index-key cache"),
        "cache pages strided": (insert(c=wide[..., : ix.RECORD_BYTES]), "index-key cache"),
        "k width": (insert(k=k[:, :64]), "k: expected"),
        "k rows": (insert(k=torch.zeros(t + 1, 128, device=device)), "k: expected"),
        "q rank": (topk(q=q[:, 0]), "q: expected"),
        "q width": (topk(q=q[..., :64]), "q: expected"),
        "weights shape": (topk(w=w[:, :1]), "weights: expected"),
        "lengths shape": (topk(lengths=lengths[:0]), "lengths: expected"),
        "topk cache": (topk(c=cache.float()), "index-key cache"),
    }
    call, named = cases[kind]
    assert_refused(call, IndexerError, named)


# =============================================================================================
# found by this file: real bugs, fixed in the ops; each property below is the test of its fix


def refused_or_correct(call, errors, named: str, check) -> None:
    """Either a typed error naming the argument, or a result that passes ``check``."""
    try:
        got = call()
    except errors as exc:
        assert named in str(exc), f"{named!r} not named in: {exc}"
        return
    check(got)


def _expanded(shape, dim: int, dtype, device) -> torch.Tensor:
    """``shape`` with ``dim`` a stride-0 expansion of one element: its writes alias."""
    one = list(shape)
    one[dim] = 1
    return torch.empty(one, dtype=dtype, device=device).expand(shape)


# Before the fix: safe_mla_query_bmm raised torch's bare RuntimeError ("more than one element
# of the written-to tensor refers to a single memory location"); absorbed_bmm (CPU
# torch.bmm(out=), the MXFP8 Triton path), the fused projection and impl="triton" wrote
# it silently (last writer wins); the staged projection and impl="reference" raised a bare
# RuntimeError from out.copy_.
@pytest.mark.parametrize(
    "op", ["safe_mla_query_bmm", "absorbed_bmm", "mla_query_projection", "sparse_mla_forward"]
)
@given(data=st.data())
@FUZZ
def test_out_with_internal_overlap_is_refused(op, data):
    """An ``out`` whose elements alias each other is refused with the op's typed error
    naming ``out`` (no op can write a correct answer into it)."""
    if op == "safe_mla_query_bmm":
        query, weight, out = (p.view for p in data.draw(bmm_calls(min_size=2)))
        out = _expanded(out.shape, 1, BF16, out.device)
        call, errors = (lambda: safe_mla_query_bmm(query, weight, out)), (TypeError, ValueError)
    elif op == "absorbed_bmm":
        device, seed = data.draw(devices), data.draw(seeds)
        b, m = data.draw(st.integers(1, 3)), data.draw(st.integers(2, 4))
        if data.draw(st.booleans()):  # MXFP8, scales along N (the Triton path)
            k, n = data.draw(st.integers(1, 40)), data.draw(st.sampled_from((32, 64)))
            t = mxfp8.quantize(randn(seed, (b, k, n)), axis=2)
            weight, dtype = MXFP8Weight(t.values.to(device), t.scales.to(device)), BF16
        else:
            k, n = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
            dtype = data.draw(st.sampled_from(ab.ACT_DTYPES))
            weight = randn(seed, (b, k, n), dtype, device)
        a = randn(seed + 1, (b, m, k), dtype, device)
        out = _expanded((b, m, n), 1, dtype, device)
        call, errors = (lambda: absorbed_bmm(a, weight, out)), AbsorbedBmmError
    elif op == "mla_query_projection":
        fused = bool(TRITON_DEVICES) and data.draw(st.booleans())
        c = data.draw(projection_calls(fused=fused, min_m=2))
        out = _expanded(c.out.view.shape, 0, c.out.view.dtype, c.q_nope.device)

        def call():
            return mla_query_projection(c.q_nope, c.weight, c.q_pe, out, q_scale=c.q_scale)

        errors = (TypeError, ValueError)
    else:
        impl = data.draw(st.sampled_from(("reference", *(("triton",) if TRITON_DEVICES else ()))))
        c = data.draw(sparse_calls(impl, min_tokens=2))
        out = _expanded((*c.q_nope.shape[:2], 512), 0, c.q_nope.dtype, c.q_nope.device)

        def call():
            return sparse_mla_forward(
                c.q, c.cache.view, c.indices, c.scale, kv_format=c.fmt, out=out, impl=impl
            )

        errors = SparseMLAError
    assert_refused(call, errors, "out")


# Before the fix: out = a (dense bf16, K == N) was not refused and CPU torch.bmm(out=) read
# what it had already written (errors of O(100)); an MXFP8 weight with N = 0 raised
# ZeroDivisionError under TRITON_INTERPRET=1 (launch._bmm_tiles: block_n =
# next_power_of_2(0) = 0, then triton.cdiv(0, 0)); a list as scales raised a bare
# AttributeError ('list' object has no attribute 'dtype') from validate().
ABSORBED_EDGES = ["out aliases a", "mxfp8 N = 0", "scales not a tensor"]


@pytest.mark.parametrize("kind", ABSORBED_EDGES)
@given(data=st.data())
@FUZZ
def test_absorbed_bmm_edge_inputs(kind, data):
    """absorbed_bmm's typed-error-or-correct contract: out aliasing a (refused by name),
    an empty MXFP8 N (an empty result), scales not a tensor (refused by name)."""
    device = data.draw(devices)
    b, m, k = (
        data.draw(st.integers(1, 3)),
        data.draw(st.integers(1, 4)),
        data.draw(st.integers(1, 40)),
    )
    seed = data.draw(seeds)
    if kind == "out aliases a":
        a = randn(seed, (b, m, k), BF16, device)
        w = randn(seed + 1, (b, k, k), BF16, device)
        a0 = a.clone()

        def check(got):
            assert_gemm_close(got, a0, w)

        refused_or_correct(lambda: absorbed_bmm(a, w, a), AbsorbedBmmError, "out", check)
    elif kind == "mxfp8 N = 0":
        along_k = data.draw(st.booleans())
        k = 32 * (k % 3) if along_k else k
        t = mxfp8.quantize(torch.zeros(b, k, 0), axis=1 if along_k else 2)
        weight = MXFP8Weight(t.values.to(device), t.scales.to(device))
        got = absorbed_bmm(randn(seed, (b, m, k), BF16, device), weight)
        assert got.shape == (b, m, 0)
    else:
        t = mxfp8.quantize(torch.zeros(b, k, 32), axis=2)
        weight = MXFP8Weight(t.values.to(device), t.scales.tolist())
        a = randn(seed, (b, m, k), BF16, device)
        assert_refused(lambda: absorbed_bmm(a, weight), AbsorbedBmmError, "weight.scales")


# Before the fix: weight.scales' device was never checked (the fused kernel read a foreign
# pointer: a meta tensor gave silent garbage of ~1e18; the staged path mixed devices); and
# out = q (q_nope / q_pe views into it) was not refused: the fused kernel wrote the latent
# part over q_pe before copying q_pe, so out[..., L:] was silently wrong (errors O(1)).
PROJECTION_EDGES = ["weight.scales device", "out aliases q"]


@pytest.mark.parametrize("kind", PROJECTION_EDGES)
@given(data=st.data())
@FUZZ
def test_query_projection_refuses_foreign_scales_and_aliased_out(kind, data):
    """mla_query_projection: scales on another device, and ``out`` aliasing q (the in-place
    projection), are refused by name (or, for the alias, correct)."""
    fused = bool(TRITON_DEVICES)
    if kind == "weight.scales device":
        c = data.draw(projection_calls(fused=fused, fmt="mxfp8"))
        values, scales = _pair(c)
        args = _replace(c, weight=(values, scales.to(other_device(values.device.type))))

        def call():
            return mla_query_projection(**args)

        assert_refused(call, (TypeError, ValueError), "weight.scales")
        return
    # out = q itself (bf16), q_nope / q_pe views into it: the in-place projection
    c = data.draw(projection_calls(fused=fused))
    m, h, p = c.q_nope.shape
    lat, rope = c.dense.shape[2], c.q_pe.shape[2]
    q = torch.zeros(m, h, max(p, lat) + rope, dtype=BF16, device=c.q_nope.device)
    q[..., :p], q[..., p : p + rope] = c.q_nope, c.q_pe
    q_nope, q_pe = c.q_nope.clone(), c.q_pe.clone()

    def call():
        return mla_query_projection(
            q[..., :p], c.weight, q[..., p : p + rope], q[..., : lat + rope]
        )

    def check(got):
        assert_projection_correct(got, q_nope, q_pe, c.dense, None)

    refused_or_correct(call, (TypeError, ValueError), "out", check)


@needs_triton
@given(data=st.data())
@FUZZ
def test_sparse_mla_triton_reads_strided_lengths_in_place(data):
    """impl="triton" with lengths a strided view equals the reference (the kernel takes
    lengths' stride; found by this file as a silent wrong answer, fixed)."""
    c = data.draw(sparse_calls("triton", min_tokens=2, lengths_step=2))
    run_sparse(c, "triton")


# Before the fix both containers accepted parts on different devices; dequantize then
# mixed them (a meta scale tensor: the unscaled e4m3 values came back silently; CUDA vs
# CPU: a bare RuntimeError).
@pytest.mark.parametrize("kind", ["MXFP8Tensor", "FP8BlockTensor"])
@given(device=devices, rows=st.integers(1, 9))
@FUZZ
def test_codec_containers_refuse_parts_on_two_devices(kind, device, rows):
    """A codec container whose parts live on different devices is refused by name
    (at construction or in dequantize)."""
    other = other_device(device)
    if kind == "MXFP8Tensor":
        t = mxfp8.quantize(torch.ones(rows, 64, device=device))

        def call():
            return mxfp8.dequantize(MXFP8Tensor(t.values, t.scales.to(other), 1))

        named = "scales"
    else:
        t = fp8_block.quantize(torch.ones(rows, 5, device=device), block=(4, 4))

        def call():
            return fp8_block.dequantize(FP8BlockTensor(t.values, t.scale_inv.to(other), t.block))

        named = "scale_inv"
    assert_refused(call, (TypeError, ValueError), named)


# Before the fix each of these crashed untyped inside the reference indexer: a slot past
# the pool, slots [T, 1], a 1-D cache or block_tables with fewer rows than T, a page or a
# length past the table (bare IndexError); a cache that is a list (AttributeError); a uint8
# cache view at a storage offset that is not a multiple of 4 (RuntimeError from the
# float32 view of the scales); topk = -1 (RuntimeError from torch.full); k on another device
# (meta: nothing written, silently).
INDEXER_EDGES = [
    "slot past the cache",
    "slots 2-D",
    "cache not a tensor",
    "cache offset",
    "k device",
    "block_tables rows",
    "page past the cache",
    "length past the table",
    "negative topk",
    "cache rank",
]


@pytest.mark.parametrize("kind", INDEXER_EDGES)
@given(t=st.integers(1, 3), nb=st.integers(1, 3), bs=st.integers(1, 4))
@FUZZ
def test_indexer_reference_refuses_bad_input_by_name(kind, t, nb, bs):
    """Wrong inputs to insert_keys / index_topk raise IndexerError naming the argument
    (CPU only: on CUDA an out-of-range index is a device-side assert)."""
    rows = nb * bs
    cache = torch.zeros(nb, bs, ix.RECORD_BYTES, dtype=torch.uint8)
    k, slots = torch.randn(t, 128), torch.arange(t) % rows
    q, w = torch.randn(t, 2, 128), torch.rand(t, 2)
    tables = torch.zeros(t, 2, dtype=torch.int32)
    lengths = torch.ones(t, dtype=torch.int32)

    def insert(c=cache, k=k, slots=slots):
        return lambda: ix.insert_keys(c, k, slots)

    def topk(c=cache, tables=tables, lengths=lengths, topk=2):
        return lambda: ix.index_topk(q, w, c, tables, lengths, topk)

    shifted = torch.zeros(nb * bs * ix.RECORD_BYTES + 1, dtype=torch.uint8)[1:]
    cases = {
        "slot past the cache": (insert(slots=slots + rows), "slots"),
        "slots 2-D": (insert(slots=slots[:, None]), "slots"),
        "cache not a tensor": (insert(c=cache.tolist()), "cache"),
        "cache offset": (insert(c=shifted.view(nb, bs, ix.RECORD_BYTES)), "cache"),
        "k device": (insert(k=k.to(other_device("cpu"))), "k"),
        "block_tables rows": (topk(tables=tables[:-1]), "block_tables"),
        "page past the cache": (topk(tables=tables + nb), "block_tables"),
        "length past the table": (topk(lengths=lengths + 2 * bs), "lengths"),
        "negative topk": (topk(topk=-1), "topk"),
        "cache rank": (topk(c=cache.view(-1), lengths=lengths * 0), "cache"),
    }
    call, named = cases[kind]
    assert_refused(call, IndexerError, named)
