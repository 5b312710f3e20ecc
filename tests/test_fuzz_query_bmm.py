"""Fuzz properties of safe_mla_query_bmm (the harness, budgets and rules: tests/fuzz.py)."""

from __future__ import annotations

import torch
from fuzz import (
    BF16,
    FUZZ,
    assert_gemm_close,
    assert_refused,
    devices,
    other_device,
    place,
    poison,
    randn,
    resized,
    seeds,
    wider_last,
)
from hypothesis import given
from hypothesis import strategies as st

from vllm_mla.ops import (
    safe_mla_query_bmm,
)


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


BMM_BAD = {
    # kind: (exception, transform of the argument)
    "float32": (TypeError, lambda t: t.float()),
    "float16": (TypeError, lambda t: t.half()),
    "list": (TypeError, lambda t: t.tolist()),
    "rank 2": (ValueError, lambda t: t[0]),
    "rank 4": (ValueError, lambda t: t[None]),
    "size H": (ValueError, lambda t: resized(t, 0)),
    "size 1": (ValueError, lambda t: resized(t, 1)),
    "size 2": (ValueError, lambda t: resized(t, 2)),
    "strided last dim": (ValueError, wider_last),
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
