"""The absorbed-weight BMM over a shape grid: Triton (interpreted on CPU) and torch paths
against the torch reference, strided views of a kv_b_proj pack, errors, custom ops."""

from __future__ import annotations

import pytest
import torch

from vllm_mla.ops import absorbed_matmul as ab
from vllm_mla.ops.absorbed_matmul import (
    AbsorbedBmmError,
    MXFP8Weight,
    absorbed_bmm,
    absorbed_bmm_reference,
    mla_v_projection,
)
from vllm_mla.ops.absorbed_matmul import reference as ab_reference
from vllm_mla.quant import mxfp8

pytest.importorskip("triton")

P, V = 128, 64


def pack(h: int, lat: int, seed: int = 0):
    """An MXFP8 kv_b_proj pack ``[h * (P + V), lat]`` and its BF16 decode."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(h * (P + V), lat, generator=gen) * 0.05
    return mxfp8.quantize(w, axis=-1)


def weight_of(role: str, fmt: str, h: int, lat: int, dtype: torch.dtype, seed: int = 0):
    """W_UK_T ``[h, P, lat]`` or W_UV ``[h, lat, V]`` as views of the pack (strided)."""
    q = pack(h, lat, seed)
    vals = q.values.unflatten(0, (h, P + V))
    codes = q.scales.unflatten(0, (h, P + V))
    if role == "W_UK_T":
        mx = MXFP8Weight(vals[:, :P, :], codes[:, :P, :])
    else:
        mx = MXFP8Weight(vals[:, P:, :].transpose(1, 2), codes[:, P:, :].transpose(1, 2))
    if fmt == "mxfp8":
        return mx
    dense = ab.decode(mx, dtype)
    return dense.contiguous() if role == "W_UK_T" else dense


def activation(role: str, h: int, m: int, lat: int, dtype: torch.dtype, seed: int = 1):
    """``[h, m, K]`` as vLLM passes it: a transposed view of a token-major tensor."""
    gen = torch.Generator().manual_seed(seed)
    k = P if role == "W_UK_T" else lat
    return torch.randn(m, h, k + 16, generator=gen).to(dtype)[..., :k].transpose(0, 1)


def assert_close_to_reference(got, a, weight):
    """Equal to the reference up to fp32 summation order (and one rounding of the result)."""
    want = absorbed_bmm_reference(a, weight)
    w = ab.decode(weight, torch.float32) if isinstance(weight, MXFP8Weight) else weight.float()
    terms = torch.bmm(a.float().abs(), w.abs())
    # each side's fp32 sum of K terms, any order: <= K * 2**-24 of sum|terms|; two sides
    tol = a.shape[-1] * 2.0**-23 * terms
    if got.dtype == torch.bfloat16:  # each side rounds once: 2 half-ulps = one bf16 ulp
        _, exp = torch.frexp(torch.maximum(got.float().abs(), want.float().abs()))
        tol = tol + torch.ldexp(torch.ones_like(tol), exp - 8)  # 8 significant bits
    assert ((got.float() - want.float()).abs() <= tol).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["mxfp8", "dense"])
@pytest.mark.parametrize("role", ["W_UK_T", "W_UV"])
@pytest.mark.parametrize("h,m", [(1, 1), (3, 5), (2, 33)])
def test_matches_reference_on_strided_pack_views(role, fmt, dtype, h, m):
    lat = 96
    weight = weight_of(role, fmt, h, lat, dtype)
    a = activation(role, h, m, lat, dtype)
    n = lat if role == "W_UK_T" else V
    big = torch.full((m, h, n + 8), float("nan"), dtype=dtype)
    out = big[..., 4 : 4 + n].transpose(0, 1)  # strided window, like vLLM's out= views
    ab.reset_calls()
    result = absorbed_bmm(a, weight, out, role=role)
    assert result is out
    assert_close_to_reference(out, a, weight)
    assert torch.isnan(big[..., :4]).all() and torch.isnan(big[..., 4 + n :]).all()
    path = ab.plan_path(*ab.parts(weight), dtype)
    assert ab.calls() == {f"{path}:{role}": 1}


def test_paths_are_chosen_by_the_weight(monkeypatch):
    mx = weight_of("W_UK_T", "mxfp8", 2, 64, torch.bfloat16)
    assert ab.plan_path(mx.values, mx.scales, torch.bfloat16) == "triton"  # interpreter on
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert ab.plan_path(mx.values, mx.scales, torch.bfloat16) == "torch-mxfp8"
    dense = ab.decode(mx, torch.bfloat16)
    assert ab.plan_path(dense, None, torch.bfloat16) == "safe"
    assert ab.plan_path(dense.float(), None, torch.float32) == "torch"
    assert ab.plan_path(dense.transpose(1, 2).contiguous().mT, None, torch.bfloat16) == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_path_is_the_reference_bit_for_bit(monkeypatch, dtype):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(ab_reference, "DECODE_SCRATCH_BYTES", 1)  # one head per chunk
    weight = weight_of("W_UV", "mxfp8", 3, 64, dtype)
    a = activation("W_UV", 3, 4, 64, dtype)
    # bit-exact: the same fp32 decode and torch.bmm on both sides, per head (batch 1) vs all
    # heads (batch 3); relies on torch's CPU bmm computing a batch matrix by matrix
    assert torch.equal(absorbed_bmm(a, weight), absorbed_bmm_reference(a, weight))


def test_triton_and_torch_paths_agree_in_fp32(monkeypatch):
    """Both paths on the same MXFP8 weight, each checked to be the path it claims (the
    call counts), against each other: fp32 products of e4m3 x 2**k and fp32 inputs are
    exact, so the two differ only by their fp32 sum orders (``assert_close_to_reference``'s
    bound, with the torch path standing in for the reference it equals bit for bit)."""
    weight = weight_of("W_UK_T", "mxfp8", 2, 64, torch.float32)
    a = activation("W_UK_T", 2, 3, 64, torch.float32)
    runs = {}
    for interpret, path in (("1", "triton"), ("0", "torch-mxfp8")):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        ab.reset_calls()
        runs[path] = absorbed_bmm(a, weight, role="W_UK_T")
        assert ab.calls() == {f"{path}:W_UK_T": 1}
    assert torch.equal(runs["torch-mxfp8"], absorbed_bmm_reference(a, weight))
    assert_close_to_reference(runs["triton"], a, weight)
    assert not torch.equal(runs["triton"], torch.zeros_like(runs["triton"]))


@pytest.mark.parametrize("path_env", ["1", "0"])
def test_a_nan_scale_poisons_its_block_only(monkeypatch, path_env):
    monkeypatch.setenv("TRITON_INTERPRET", path_env)
    weight = weight_of("W_UV", "mxfp8", 1, 64, torch.float32)
    scales = weight.scales.clone()
    scales[0, 1, 3] = mxfp8.SCALE_NAN  # latent rows 32..63 of output column 3
    weight = MXFP8Weight(weight.values, scales)
    a = activation("W_UV", 1, 2, 64, torch.float32)
    out = absorbed_bmm(a, weight)
    assert torch.isnan(out[0, :, 3]).all()
    assert not torch.isnan(out[0, :, :3]).any() and not torch.isnan(out[0, :, 4:]).any()


def test_mla_v_projection_takes_token_major_tensors():
    h, t, lat = 3, 4, 64
    weight = weight_of("W_UV", "mxfp8", h, lat, torch.bfloat16)
    x = torch.randn(t, h, lat).bfloat16()
    out = torch.empty(t, h, V, dtype=torch.bfloat16)
    assert mla_v_projection(x, weight, out) is out
    assert_close_to_reference(out.transpose(0, 1), x.transpose(0, 1), weight)


def test_custom_ops_pass_opcheck():
    weight = weight_of("W_UK_T", "mxfp8", 2, 64, torch.bfloat16)
    a = activation("W_UK_T", 2, 3, 64, torch.bfloat16).contiguous()
    out = torch.empty(2, 3, 64, dtype=torch.bfloat16)
    dense = ab.decode(weight, torch.bfloat16)
    for op, args in (
        (torch.ops.vllm_mla.absorbed_bmm_out.default, (a, dense, None, out, "")),
        (torch.ops.vllm_mla.absorbed_bmm.default, (a, dense, None, "")),
    ):
        torch.library.opcheck(op, args)
    # e4m3 operands: the schema checker multiplies inputs, which CPU fp8 cannot
    torch.library.opcheck(
        torch.ops.vllm_mla.absorbed_bmm_out.default,
        (a, weight.values, weight.scales, out, ""),
        test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
    )


def _bad_cases():
    mx = weight_of("W_UK_T", "mxfp8", 2, 64, torch.bfloat16)
    a = activation("W_UK_T", 2, 3, 64, torch.bfloat16)
    dense = ab.decode(mx, torch.bfloat16)
    out = torch.empty(2, 3, 64, dtype=torch.bfloat16)
    return [
        ("a 2-D", (a[0], mx, None), "a must be a 3-D"),
        ("a fp16 mxfp8", (a.half(), mx, None), "an MXFP8 weight takes a in"),
        ("dtype mismatch", (a.float(), dense, None), "differs from a's"),
        ("heads", (a[:1], mx, None), "does not fit a"),
        ("K", (a[..., :64], mx, None), "does not fit a"),
        ("values dtype", (a, MXFP8Weight(dense, mx.scales), None), "float8_e4m3fn"),
        ("scales dtype", (a, MXFP8Weight(mx.values, mx.scales.int()), None), "weight.scales"),
        ("scales shape", (a, MXFP8Weight(mx.values, mx.scales[..., :1]), None), "fits neither"),
        ("out shape", (a, mx, out[:, :2]), "out must be"),
        ("out dtype", (a, mx, out.float()), "out must be"),
        ("scales a list", (a, MXFP8Weight(mx.values, mx.scales.tolist()), None), "weight.scales"),
        ("out a list", (a, mx, out.tolist()), "out must be"),
        ("out expanded", (a, mx, out[:, :1].expand(2, 3, 64)), "out has elements that share"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_errors_name_the_operand(case):
    _, args, message = case
    with pytest.raises(AbsorbedBmmError, match=message):
        absorbed_bmm(*args)


@pytest.mark.parametrize("into", ["a", "weight"])
def test_out_overlapping_an_input_is_refused(into):
    # CPU torch.bmm(out=a) reads what it already wrote: a wrong answer, not a refusal
    a = torch.randn(2, 3, 64).bfloat16()
    w = torch.randn(2, 64, 64).bfloat16()
    out = a if into == "a" else w[:, :3]
    with pytest.raises(AbsorbedBmmError, match=f"out overlaps {into}"):
        absorbed_bmm(a, w, out)


@pytest.mark.parametrize("path_env", ["1", "0"])
@pytest.mark.parametrize("along_k", [True, False])
def test_an_empty_mxfp8_n_gives_an_empty_result(monkeypatch, path_env, along_k):
    monkeypatch.setenv("TRITON_INTERPRET", path_env)  # the Triton launch, then torch
    t = mxfp8.quantize(torch.zeros(2, 64, 0), axis=1 if along_k else 2)
    a = torch.randn(2, 3, 64).bfloat16()
    got = absorbed_bmm(a, MXFP8Weight(t.values, t.scales))
    assert got.shape == (2, 3, 0) and got.dtype == torch.bfloat16
    out = torch.empty(2, 3, 0, dtype=torch.bfloat16)
    assert absorbed_bmm(a, MXFP8Weight(t.values, t.scales), out) is out


def test_device_mismatch_is_named():
    mx = weight_of("W_UK_T", "mxfp8", 1, 32, torch.bfloat16)
    a = torch.empty(1, 1, P, dtype=torch.bfloat16, device="meta")
    with pytest.raises(AbsorbedBmmError, match="is on cpu but a is on meta"):
        absorbed_bmm(a, mx)
