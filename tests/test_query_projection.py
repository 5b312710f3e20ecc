"""Fused MLA query projection (Triton, interpreted on CPU) against the staged reference."""

from __future__ import annotations

import pytest
import torch

from vllm_mla import envs
from vllm_mla.ops import capture
from vllm_mla.ops.base import MXFP8Weight
from vllm_mla.ops.query_projection import (
    QueryProjectionNotPrewarmed,
    can_fuse_query_projection,
    mla_query_projection,
    prewarm_query_projection,
    staged_query_projection,
)
from vllm_mla.ops.query_projection import reference as qp_reference
from vllm_mla.quant import mxfp8

pytest.importorskip("triton")
from vllm_mla.ops.query_projection import kernel as qp_kernel

L, R, V = 512, 64, 128


def make_inputs(m, h, p, fmt, *, seed=0, out_dtype=torch.bfloat16, pad_out=16):
    """Decode-shaped views: q_nope/q_pe split from one q, W_UK_T a view of the kv_b pack,
    out a strided window of a larger buffer."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(m, h, p + R, generator=gen).bfloat16()
    pack = torch.randn(h, p + V, L, generator=gen) * 0.05
    if fmt == "mxfp8":
        t = mxfp8.quantize(pack, axis=-1)
        weight = MXFP8Weight(t.values[:, :p, :], t.scales[:, :p, :])
    else:
        weight = pack.bfloat16()[:, :p, :]
    big = torch.zeros(m, h, L + R + pad_out, dtype=out_dtype)
    out = big[..., pad_out:]
    return q[..., :p], weight, q[..., p:], out


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    _, exponent = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def assert_within_one_bf16_ulp(got, ref, q_nope, weight):
    """|got - ref| <= one bf16 ulp, plus the fp32 summation-order bound P * 2**-23 * sum|q w|
    (which only matters under cancellation, where the result is far below its terms)."""
    w = qp_reference.bf16_weight(weight).float()
    terms = torch.bmm(q_nope.float().abs().transpose(0, 1), w.abs()).transpose(0, 1)
    tol = bf16_ulp(torch.maximum(got.float().abs(), ref.float().abs()))  # 2 half-ulp roundings
    tol = tol + q_nope.shape[-1] * 2.0**-23 * terms  # 2 fp32 sums, each <= P * 2**-24 * terms
    assert ((got.float() - ref.float()).abs() <= tol).all()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("p", [128, 192])
@pytest.mark.parametrize("h", [1, 8, 11, 16])
@pytest.mark.parametrize("m", [1, 5, 32])
def test_fused_matches_staged_within_one_bf16_ulp(m, h, p, fmt):
    q_nope, w, q_pe, out = make_inputs(m, h, p, fmt)
    assert out.storage_offset() > 0 and q_pe.storage_offset() == p
    assert can_fuse_query_projection(
        num_heads=h,
        max_m=m,
        nope_dim=p,
        latent_dim=L,
        out_dtype=out.dtype,
        weight_format=fmt,
        device="cpu",
    )
    ref = torch.empty(out.shape, dtype=out.dtype)
    staged_query_projection(q_nope, w, q_pe, ref)
    mla_query_projection(q_nope, w, q_pe, out)
    assert torch.equal(out[..., L:], q_pe)
    assert_within_one_bf16_ulp(out[..., :L], ref[..., :L], q_nope, w)
    # Statistical: the bf16 results differ only where the two fp32 sums (|diff| ~ sqrt(P) *
    # 2**-24 of the partial sums, ~1e-6 relative) straddle a rounding point, ~1e-6 / 2**-8:
    # a few 1e-4 of the elements; 1% is 30x that and catches a wrong rounding mode (~50%).
    assert (out[..., :L] != ref[..., :L]).float().mean() < 0.01


def fp8_of(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 rule applied by torch: e4m3(clamp(bf16 / q_scale, -448, 448))."""
    return (values.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize(("m", "h", "p"), [(1, 11, 128), (5, 16, 192), (32, 8, 128)])
@pytest.mark.parametrize("scale", [0.01, 0.37, 3.0])
def test_fp8_output(m, h, p, fmt, scale):
    q_nope, w, q_pe, out = make_inputs(m, h, p, fmt, out_dtype=torch.float8_e4m3fn)
    bf16 = torch.empty(out.shape, dtype=torch.bfloat16)
    mla_query_projection(q_nope, w, q_pe, bf16)
    q_scale = torch.tensor(scale, dtype=torch.float32)
    mla_query_projection(q_nope, w, q_pe, out, q_scale=q_scale)
    # Exact: the kernel quantizes its own bf16 result exactly as torch does (the
    # interpreter branch rounds on the bits, so no interpreter tolerance is needed).
    assert torch.equal(out.view(torch.uint8), fp8_of(bf16, q_scale).view(torch.uint8))
    ref = torch.empty(out.shape, dtype=out.dtype)
    staged_query_projection(q_nope, w, q_pe, ref, q_scale=q_scale)
    ref_bf16 = torch.empty(out.shape, dtype=torch.bfloat16)
    staged_query_projection(q_nope, w, q_pe, ref_bf16)
    # Both paths quantize their own bf16 exactly, so the codes differ only where the bf16
    # values do (by the fp32-order bound of test_fused_matches_staged_within_one_bf16_ulp,
    # which under cancellation and a small q_scale can span several e4m3 subnormal steps).
    assert torch.equal(ref.view(torch.uint8), fp8_of(ref_bf16, q_scale).view(torch.uint8))
    assert_within_one_bf16_ulp(bf16[..., :L], ref_bf16[..., :L], q_nope, w)
    assert not ((out.view(torch.uint8) != ref.view(torch.uint8)) & (bf16 == ref_bf16)).any()
    assert torch.equal(out[..., L:].view(torch.uint8), ref[..., L:].view(torch.uint8))


def test_fp8_saturates_and_rounds_ties_to_even():
    m, h, p = 1, 1, 128
    q_nope, w, q_pe, out = make_inputs(m, h, p, "bf16", out_dtype=torch.float8_e4m3fn)
    # q_pe carries chosen values straight to the quantizer: ties, tiny, huge.
    probe = torch.tensor([1.0625, 1.1875, 1000.0, -1000.0, 0.0009765625, 0.0029296875, 0, -0.0])
    q_pe[0, 0, : probe.numel()] = probe.bfloat16()
    one = torch.tensor(1.0)
    mla_query_projection(q_nope, w, q_pe, out, q_scale=one)
    got = out[0, 0, L : L + probe.numel()].float()
    want = fp8_of(probe.bfloat16(), one).float()
    assert torch.equal(got, want)
    assert got[:4].tolist() == [1.0, 1.25, 448.0, -448.0]


def test_fp8_divides_by_q_scale_exactly():
    """-0.0888671875 / 7 is a tie in e4m3's subnormal range (found by search): division
    rounds it to -0.01171875, a multiply by fl(1/7) to -0.013671875."""
    q_nope, w, q_pe, out = make_inputs(1, 1, 128, "bf16", out_dtype=torch.float8_e4m3fn)
    q_pe[0, 0, 0] = -0.0888671875
    mla_query_projection(q_nope, w, q_pe, out, q_scale=torch.tensor(7.0))
    assert out[0, 0, L].float().item() == -0.01171875


def test_mxfp8_extreme_scale_codes():
    """Scale code 0 is 2**-127 (not 0) and 255 is NaN, as the codec decodes them."""
    h, p = 1, 128
    t = mxfp8.quantize(torch.ones(h, p, L), axis=-1)
    scales = t.scales.clone()
    scales[0, 3, 0] = 0  # row 3, first 32 columns: 256 (the e4m3 value) * 2**-127
    scales[0, 5, 1] = 255  # row 5, columns 32..63: NaN
    weight = MXFP8Weight(t.values, scales)
    q = torch.zeros(2, h, p + R, dtype=torch.bfloat16)
    q[0, 0, 3] = 1.0  # selects row 3
    q[1, 0, 5] = 1.0  # selects row 5
    out = torch.empty(2, h, L + R, dtype=torch.bfloat16)
    mla_query_projection(q[..., :p], weight, q[..., p:], out)
    assert out[0, 0, :32].float().eq(2.0**-119).all()
    # NaN columns poison every row (0 * NaN), exactly as the staged bmm does.
    assert out[:, 0, 32:64].float().isnan().all() and not out[:, 0, :32].float().isnan().any()
    ref = torch.empty_like(out)
    staged_query_projection(q[..., :p], weight, q[..., p:], ref)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)


def count_paths(monkeypatch):
    calls = {"fused": 0, "staged": 0}
    real_fused, real_staged = qp_kernel.launch, qp_reference.staged

    def fused(*a, **k):
        calls["fused"] += 1
        return real_fused(*a, **k)

    def staged(*a, **k):
        calls["staged"] += 1
        return real_staged(*a, **k)

    monkeypatch.setattr(qp_kernel, "launch", fused)
    monkeypatch.setattr(qp_reference, "staged", staged)
    return calls


def run(m, h, p, latent=L, rope=R, out_dtype=torch.bfloat16):
    q = torch.randn(m, h, p + rope).bfloat16()
    w = torch.randn(h, p, latent).bfloat16()
    out = torch.empty(m, h, latent + rope, dtype=out_dtype)
    scale = torch.tensor(1.0)
    mla_query_projection(q[..., :p], w, q[..., p:], out, q_scale=scale)
    ref = torch.empty_like(out)
    staged_query_projection(q[..., :p], w, q[..., p:], ref, q_scale=scale)
    return out, ref


@pytest.mark.parametrize(
    "shape",
    [
        {"m": 65, "h": 2, "p": 128},  # M above the gate
        {"m": 2, "h": 129, "p": 128},  # too many heads
        {"m": 2, "h": 2, "p": 64},  # nope dim outside {128, 192}
        {"m": 2, "h": 2, "p": 128, "latent": 256},  # L != 512
        {"m": 2, "h": 2, "p": 128, "rope": 32},  # R != 64
    ],
)
def test_shapes_outside_the_gate_run_staged(monkeypatch, shape):
    calls = count_paths(monkeypatch)
    out, ref = run(**shape)
    assert calls == {"fused": 0, "staged": 2}
    assert torch.equal(out, ref)


def test_gated_shape_runs_fused(monkeypatch):
    calls = count_paths(monkeypatch)
    run(64, 1, 192)
    assert calls == {"fused": 1, "staged": 1}


def test_no_triton_device_runs_staged(monkeypatch):
    calls = count_paths(monkeypatch)
    monkeypatch.setattr(envs, "triton_interpret", lambda: False)
    run(4, 2, 128)
    assert calls == {"fused": 0, "staged": 2}


def test_gate_rules():
    ok = {
        "num_heads": 11,
        "max_m": 64,
        "nope_dim": 192,
        "latent_dim": 512,
        "out_dtype": torch.float8_e4m3fn,
        "weight_format": "mxfp8",
        "device": "cpu",
    }
    assert can_fuse_query_projection(**ok)
    for key, bad in [
        ("num_heads", 0),
        ("max_m", 0),
        ("nope_dim", 256),
        ("latent_dim", 576),
        ("out_dtype", torch.float16),
        ("weight_format", "fp8-block"),
        ("device", "meta"),
    ]:
        assert not can_fuse_query_projection(**{**ok, key: bad}), key


def good(m=2, h=2, p=128):
    q = torch.randn(m, h, p + R).bfloat16()
    return {
        "q_nope": q[..., :p],
        "weight": torch.randn(h, p, L).bfloat16(),
        "q_pe": q[..., p:],
        "out": torch.empty(m, h, L + R, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"q_nope": torch.randn(2, 2, 128)}, TypeError, "q_nope: expected dtype"),
        ({"q_pe": torch.randn(3, 2, 64).bfloat16()}, ValueError, "q_pe: expected \\[M=2"),
        ({"out": torch.empty(2, 2, 576, dtype=torch.float16)}, TypeError, "out: expected dtype"),
        ({"out": torch.empty(2, 2, 575, dtype=torch.bfloat16)}, ValueError, "out: expected shape"),
        ({"weight": torch.randn(2, 128, 512)}, TypeError, "weight: expected dtype"),
        ({"weight": torch.randn(3, 128, 512).bfloat16()}, ValueError, "weight: expected \\[H=2"),
        ({"q_nope": torch.randn(2, 2).bfloat16()}, ValueError, "q_nope: expected 3-D"),
        (
            {"q_nope": torch.randn(2, 2, 256).bfloat16()[..., ::2]},
            ValueError,
            "q_nope: last dim must be contiguous",
        ),
        (
            {"out": torch.empty(2, 2, 576, dtype=torch.float8_e4m3fn)},
            ValueError,
            "q_scale: required",
        ),
        (
            {
                "weight": (
                    torch.zeros(2, 128, 512, dtype=torch.float8_e4m3fn),
                    torch.zeros(2, 128, 15, dtype=torch.uint8),
                )
            },
            ValueError,
            "weight.scales: expected shape",
        ),
        (
            {"weight": (torch.zeros(2, 128, 512), torch.zeros(2, 128, 16, dtype=torch.uint8))},
            TypeError,
            "weight.values: expected dtype",
        ),
        (
            {"q_pe": torch.empty(2, 2, 64, dtype=torch.bfloat16, device="meta")},
            ValueError,
            "q_pe: expected device",
        ),
        (
            {
                "weight": (
                    torch.zeros(2, 128, 512, dtype=torch.float8_e4m3fn),
                    torch.zeros(2, 128, 16, dtype=torch.uint8, device="meta"),
                )
            },
            ValueError,
            "weight.scales: expected device cpu",
        ),
        (
            {"out": torch.empty(1, 2, 576, dtype=torch.bfloat16).expand(2, 2, 576)},
            ValueError,
            "out: expected distinct memory per element",
        ),
    ],
)
def test_bad_input_names_the_argument(change, exc, match):
    args = {**good(), **change}
    with pytest.raises(exc, match=match):
        mla_query_projection(**args)


@pytest.mark.parametrize("part", ["q_nope", "q_pe", "weight"])
def test_out_overlapping_an_input_is_refused(part):
    # In place (out = q) the fused kernel overwrites q_pe with the latent part before
    # copying it: a silent wrong answer, so every overlap is refused.
    args = good()
    buf = torch.zeros(2, 2, 640, dtype=torch.bfloat16)
    if part == "weight":
        args["out"] = args["weight"].view(-1)[: 2 * 2 * 576].view(2, 2, 576)
    else:  # out = q[..., :576] with the part a view of the same buffer
        args[part] = buf[..., : args[part].shape[-1]]
        args["out"] = buf[..., :576]
    with pytest.raises(ValueError, match=f"out: expected a buffer separate .* overlapping {part}"):
        mla_query_projection(**args)


def test_q_scale_must_be_an_fp32_scalar():
    args = good()
    args["out"] = torch.empty(2, 2, 576, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="q_scale: expected a float32"):
        mla_query_projection(**args, q_scale=torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="q_scale: expected 1 element"):
        mla_query_projection(**args, q_scale=torch.ones(2))


def test_prewarm_compiles_every_gated_m_and_capture_refuses_new_variants(monkeypatch):
    monkeypatch.setattr(capture, "_compiled", set())
    assert (
        prewarm_query_projection(
            [1, 2, 3, 65], num_heads=3, nope_dim=192, weight_format="mxfp8", device="cpu"
        )
        == 3
    )
    assert {v[4] for v in capture.compiled_variants()} == {16}  # M 1..3 share one tile bucket
    monkeypatch.setattr(capture, "capturing", lambda device: True)
    m, h, p = 3, 3, 192
    q = torch.zeros(m, h, p + R).bfloat16()
    t = mxfp8.quantize(torch.zeros(h, p, L), axis=-1)
    out = torch.empty(m, h, L + R, dtype=torch.bfloat16)
    mla_query_projection(q[..., :p], (t.values, t.scales), q[..., p:], out)  # prewarmed: fine
    q32 = torch.zeros(32, h, p + R).bfloat16()
    out32 = torch.empty(32, h, L + R, dtype=torch.bfloat16)
    with pytest.raises(QueryProjectionNotPrewarmed, match="M bucket 32"):
        mla_query_projection(q32[..., :p], (t.values, t.scales), q32[..., p:], out32)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_custom_op_passes_opcheck(fmt, out_dtype):
    q_nope, w, q_pe, out = make_inputs(3, 2, 128, fmt, out_dtype=out_dtype)
    values, scales = (w.values, w.scales) if fmt == "mxfp8" else (w, None)
    scale = torch.tensor(0.5) if out_dtype == torch.float8_e4m3fn else None
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    utils += ("test_aot_dispatch_dynamic",)
    if fmt == "mxfp8" or out_dtype == torch.float8_e4m3fn:
        # opcheck's schema check compares tensors with ops CPU torch lacks for float8
        # ("mul_cpu_reduced_float"); the mutation schema is covered by the bf16 case.
        utils = utils[1:]
    torch.library.opcheck(
        torch.ops.vllm_mla.mla_query_projection,
        (q_nope, values, scales, q_pe, out, scale),
        test_utils=utils,
    )


def test_compiles_as_one_opaque_op():
    q_nope, w, q_pe, out = make_inputs(2, 2, 128, "bf16")

    @torch.compile(fullgraph=True, backend="eager")
    def project(q_nope, w, q_pe, out):
        torch.ops.vllm_mla.mla_query_projection(q_nope, w, None, q_pe, out, None)
        return out

    ref = torch.empty(out.shape, dtype=out.dtype)
    staged_query_projection(q_nope, w, q_pe, ref)
    assert_within_one_bf16_ulp(project(q_nope, w, q_pe, out)[..., :L], ref[..., :L], q_nope, w)
