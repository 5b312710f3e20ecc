"""The deferred query absorption (``vllm_mla.ops.query_fusion``) on routed weights, written as
vLLM's ``forward_impl`` writes the query (bmm into a token-major buffer, then the consumer):
one projection where vLLM runs bmm + cat (+ quant), the staged values within the contract,
and every way a consumer can decline leaving no value missing.

The Triton kernel runs in Triton's interpreter here (tests/conftest.py); its interpreter
branch rounds like the GPU (query_projection kernel docstring).
"""

from __future__ import annotations

import threading

import pytest
import torch
from compile_support import needs_subclass_compile
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_mla.ops import absorbed_matmul as ab
from vllm_mla.ops import query_fusion as qf
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.ops.base import MXFP8Weight
from vllm_mla.ops.query_projection import staged_query_projection
from vllm_mla.quant import mxfp8

pytest.importorskip("triton")
from vllm_mla.ops import capture

H, P, L, R = 4, 128, 512, 64


def weight(fmt: str, dtype=torch.bfloat16, path=None, seed=0) -> nn.Parameter:
    """W_UK_T [H, P, L] routed: MXFP8 views of a pack, or its dense decode."""
    gen = torch.Generator().manual_seed(seed)
    t = mxfp8.quantize(torch.randn(H * P, L, generator=gen) * 0.05, axis=-1)
    view = MXFP8Weight(t.values.unflatten(0, (H, P)), t.scales.unflatten(0, (H, P)))
    if fmt == "mxfp8":
        w = AbsorbedWeight.mxfp8(view, dtype, "W_UK_T")
    else:
        w = AbsorbedWeight.dense(ab.decode(view, dtype).contiguous(), "W_UK_T", path=path)
    return nn.Parameter(w, requires_grad=False)


def fused(w, kernel=True, max_m=64) -> qf.QueryFusion:
    f = qf.QueryFusion(w, rope=R, max_m=max_m, kernel=kernel)
    w.attach_fusion(f)
    return f


def decode_query(m, dtype=torch.bfloat16, seed=1):
    """vLLM's decode query: ``q [M, H, P + R]`` split into views, a NaN-poisoned ``[M, H, L]``
    buffer for the bmm (as ``mqa_q_nope.new_empty((B, N, L))``)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(m, H, P + R, generator=gen).to(dtype)
    ql = torch.full((m, H, L), float("nan"), dtype=dtype)
    return q[..., :P], q[..., P:], ql


def forward_impl_bmm(q_nope, w, ql):
    """``torch.bmm(mqa_q_nope, W_UK_T, out=mqa_ql_nope.transpose(0, 1))`` as vLLM writes it."""
    return torch.bmm(q_nope.transpose(0, 1), w, out=ql.transpose(0, 1))


def staged(q_nope, w, q_pe, out_dtype=None, q_scale=None):
    out = torch.empty(
        q_nope.shape[0], H, L + R, dtype=out_dtype or q_nope.dtype, device=q_nope.device
    )
    return staged_query_projection(q_nope, w.weight, q_pe, out, q_scale=q_scale)


def bf16_ulp(x):
    _, exponent = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


def assert_one_bf16_ulp(got, ref, q_nope, w):
    """The contract: |fused - staged| <= one bf16 ulp (two half-ulp roundings of the same
    value) plus P * 2**-23 * sum|q w| (two fp32 sums of P terms in other orders, which only
    shows under cancellation)."""
    dense = ab.decode(w.weight, torch.float32) if w.kind == "mxfp8" else w._values.float()
    terms = torch.bmm(q_nope.float().abs().transpose(0, 1), dense.abs()).transpose(0, 1)
    tol = bf16_ulp(torch.maximum(got.float().abs(), ref.float().abs())) + P * 2.0**-23 * terms
    assert ((got.float() - ref.float()).abs() <= tol).all()


@pytest.fixture(autouse=True)
def _clean():
    qf.disarm()
    qf.reset_calls()
    ab.reset_calls()
    yield
    qf.disarm()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_one_projection_replaces_bmm_and_cat(fmt, m):
    w = weight(fmt)
    f = fused(w)
    q_nope, q_pe, ql = decode_query(m)
    qf.arm(f)
    out = ql.transpose(0, 1)
    assert torch.bmm(q_nope.transpose(0, 1), w, out=out) is out
    assert qf.pending() and torch.isnan(ql).all()  # deferred: nothing ran, nothing written
    assert ab.calls() == {}
    q = qf.project_bf16(ql, q_pe)
    assert q is not None and q.shape == (m, H, L + R) and q.is_contiguous()
    assert not qf.pending() and qf.calls() == {"forward_mqa:triton": 1}
    ref = staged(q_nope, w, q_pe)
    assert torch.equal(q[..., L:], q_pe)
    assert_one_bf16_ulp(q[..., :L], ref[..., :L], q_nope, w)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_fp8_consumer_quantizes_the_projection(fmt):
    w = weight(fmt)
    f = fused(w)
    q_nope, q_pe, ql = decode_query(3)
    scale = torch.tensor(0.07, dtype=torch.float32)
    qf.arm(f)
    forward_impl_bmm(q_nope, w, ql)
    q = qf.project_fp8(ql, q_pe, scale)
    assert q.dtype == torch.float8_e4m3fn and qf.calls() == {"concat_quant_fp8:triton": 1}
    # the kernel quantizes its own bf16 result exactly as torch does (kernel docstring), so
    # the codes are those of the bf16 projection (<= 1 bf16 ulp from staged, above)
    qf.arm(f)
    forward_impl_bmm(q_nope, w, ql)
    bf16 = qf.project_bf16(ql, q_pe)
    want = (bf16.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_torch_path_is_the_staged_path_exactly(dtype, fmt):
    """Off the kernel (CPU engines, fp32) the consumer runs query_projection's own staged
    path: the same bmm, the same values, bit for bit."""
    w = weight(fmt, dtype, path="torch" if fmt == "bf16" else None)
    f = fused(w, kernel=False)
    q_nope, q_pe, ql = decode_query(5, dtype)
    qf.arm(f)
    forward_impl_bmm(q_nope, w, ql)
    q = qf.project_bf16(ql, q_pe)
    assert qf.calls() == {"forward_mqa:torch": 1}
    # what vLLM would have run: the bmm into its buffer, then the backend's cat
    qf.disarm()
    forward_impl_bmm(q_nope, w, ql)
    assert torch.equal(q, torch.cat([ql, q_pe], dim=-1))


def consumed_values(w, q_nope, ql):
    """What an unfused bmm writes into vLLM's buffer."""
    want = torch.empty_like(ql)
    torch.bmm(q_nope.transpose(0, 1), w.dense_values(), out=want.transpose(0, 1))
    return want


def assert_bmm_ran(w, q_nope, ql):
    assert not torch.isnan(ql).any()
    want = consumed_values(w, q_nope, ql)
    torch.testing.assert_close(ql, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "decline",
    ["other buffer", "q_pe shape", "q_pe dtype", "scale_ub", "q_scale dtype", "not prewarmed"],
)
def test_a_consumer_that_declines_runs_the_bmm_first(monkeypatch, decline):
    w = weight("bf16")
    f = fused(w)
    q_nope, q_pe, ql = decode_query(3)
    qf.arm(f)
    forward_impl_bmm(q_nope, w, ql)
    scale, scale_ub = torch.tensor(0.5), None
    if decline == "other buffer":
        result = qf.project_bf16(ql.clone(), q_pe)
    elif decline == "q_pe shape":
        result = qf.project_bf16(ql, q_pe[:2])
    elif decline == "q_pe dtype":
        result = qf.project_bf16(ql, q_pe.float())
    elif decline == "not prewarmed":
        monkeypatch.setattr(capture, "_compiled", set())
        monkeypatch.setattr(capture, "capturing", lambda device: True)
        result = qf.project_bf16(ql, q_pe)
    else:
        if decline == "scale_ub":
            scale_ub = torch.tensor(1.0)
        else:
            scale = scale.double()
        result = qf.project_fp8(ql, q_pe, scale, scale_ub)
    assert result is None and not qf.pending()
    why = "not prewarmed" if decline == "not prewarmed" else "declined"
    assert qf.calls() == {f"flushed:{why}": 1}
    assert ab.calls() == {"safe:W_UK_T": 1}
    assert_bmm_ran(w, q_nope, ql)  # vLLM's own path now reads a complete buffer


def test_nothing_pending_means_the_consumer_passes_through():
    _, q_pe, ql = decode_query(2)
    assert qf.project_bf16(ql, q_pe) is None
    assert qf.project_fp8(ql, q_pe, torch.tensor(1.0)) is None
    assert qf.calls() == {}


@pytest.mark.parametrize(
    "case", ["not armed", "other layer armed", "m above max", "padded-head buffer", "no out"]
)
def test_bmms_that_do_not_defer_run_at_once(case):
    w = weight("bf16")
    f = fused(w, max_m=4)
    q_nope, _, ql = decode_query(5 if case == "m above max" else 3)
    if case != "not armed":
        qf.arm(fused(weight("bf16", seed=3)) if case == "other layer armed" else f)
    if case == "padded-head buffer":  # forward_impl's q_pad_num_heads branch: [N, B, L]
        out = torch.full((H, q_nope.shape[0], L), float("nan"), dtype=torch.bfloat16)
        torch.bmm(q_nope.transpose(0, 1), w, out=out)
        assert not torch.isnan(out).any()
    elif case == "no out":
        torch.bmm(q_nope.transpose(0, 1), w)
    else:
        forward_impl_bmm(q_nope, w, ql)
        assert_bmm_ran(w, q_nope, ql)
    assert not qf.pending() and ab.calls() == {"safe:W_UK_T": 1}


@pytest.mark.parametrize("by", ["second deferral", "other routed bmm", "disarm", "arm"])
def test_a_bmm_nobody_took_runs_before_anything_else(by):
    w = weight("bf16")
    f = fused(w)
    q_nope, _, ql = decode_query(3)
    qf.arm(f)
    forward_impl_bmm(q_nope, w, ql)
    if by == "second deferral":
        forward_impl_bmm(q_nope, w, torch.empty_like(ql))
    elif by == "other routed bmm":
        other = weight("bf16", seed=2)
        torch.bmm(q_nope.transpose(0, 1), other)
    elif by == "disarm":
        qf.disarm()
    else:
        qf.arm(f)
    assert qf.calls()["flushed:unclaimed"] == 1
    assert_bmm_ran(w, q_nope, ql)


def test_pending_state_is_per_thread():
    w = weight("bf16")
    f = fused(w)
    q_nope, q_pe, ql = decode_query(2)
    qf.arm(f)
    forward_impl_bmm(q_nope, w, ql)
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(pending=qf.pending()))
    thread.start()
    thread.join()
    assert seen == {"pending": False} and qf.pending()
    assert qf.project_bf16(ql, q_pe) is not None


class Ops(TorchDispatchMode):
    """Every aten op that reaches the dispatcher, allocations included, views left out
    (vLLM's own transposes and splits cost no kernel)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def test_hot_path_defers_without_ops_and_projects_with_one_allocation():
    """Deferral dispatches nothing; the consumer allocates the query (the concat's output it
    replaces) and launches one kernel (stubbed here: the interpreter itself runs torch ops)."""
    w = weight("bf16")
    f = fused(w)
    q_nope, q_pe, ql = decode_query(2)
    qf.arm(f)
    launches = []
    f._launch = lambda *a: launches.append(a)
    with Ops() as mode:
        forward_impl_bmm(q_nope, w, ql)
        deferred = list(mode.ops)
        q = qf.project_bf16(ql, q_pe)
    assert deferred == [] and q is not None
    assert [op for op in mode.ops if op != "empty"] == [] and mode.ops.count("empty") == 1
    assert len(launches) == 1 and launches[0][3] is q


def test_args_are_built_once_per_m():
    w = weight("bf16")
    f = fused(w)
    assert f.args(3, False) is f.args(3, False) and f.args(3, True) is not f.args(3, False)
    assert f.args(3, False).weight is w._values


# -- DSA row layout ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_row_layout_returns_the_left_part_of_one_query_buffer(fmt):
    plain = weight(fmt)
    rows = nn.Parameter(plain.rebound(row_width=L + R), requires_grad=False)
    assert rows.row_width == L + R and rows._values is plain._values
    q_nope, q_pe, _ = decode_query(5)
    # DeepseekV32Attention.forward: torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)
    ql = torch.bmm(q_nope.transpose(0, 1), rows).transpose(0, 1)
    want = torch.bmm(q_nope.transpose(0, 1), plain).transpose(0, 1)
    assert ql.stride() == (H * (L + R), L + R, 1) and torch.equal(ql, want)
    assert qf.is_row_query(ql, q_pe) and qf.is_row_query(ql[:2], q_pe[:2])
    full = qf.row_query(ql[:4], q_pe[:4])  # vLLM passes ql_nope[:num_actual]
    assert full.shape == (4, H, L + R) and full.is_contiguous()
    assert full.data_ptr() == ql.data_ptr()  # the same buffer: only q_pe was copied
    assert torch.equal(full[..., :L], want[:4]) and torch.equal(full[..., L:], q_pe[:4])
    assert qf.calls() == {"rows:copy_pe": 1}


def test_other_layouts_are_not_row_queries():
    _, q_pe, ql = decode_query(3)
    assert not qf.is_row_query(ql, q_pe)  # vLLM's [M, H, L] buffer
    assert not qf.is_row_query(ql.transpose(0, 1).contiguous().transpose(0, 1), q_pe)
    big = torch.empty(3, H, L + R, dtype=torch.bfloat16)
    assert not qf.is_row_query(big[..., :L], q_pe.float())
    # the right part would run past the storage: a [T, H, L] view at the end of a buffer
    tail = torch.empty(3 * H * (L + R), dtype=torch.bfloat16)[-(3 * H * (L + R) - R) :]
    view = tail[: 3 * H * (L + R) - R].as_strided((3, H, L), (H * (L + R), L + R, 1))
    assert not qf.is_row_query(view, q_pe)
    assert qf.row_query(ql, q_pe) is None


@needs_subclass_compile
@pytest.mark.parametrize("kind", ["safe", "direct"])
def test_row_layout_compiles_with_the_same_strides(kind):
    """The DSA absorption compiled (Inductor): the bmm is one custom-op node whose result
    keeps the row layout, so the eager consumer finds one buffer."""
    plain = weight("mxfp8" if kind == "direct" else "bf16", torch.float32)
    rows = nn.Parameter(plain.rebound(row_width=L + R), requires_grad=False)

    def absorption(q, w):
        q_nope, q_pe = q.split([P, R], dim=-1)
        return torch.bmm(q_nope.transpose(0, 1), w).transpose(0, 1), q_pe

    torch._dynamo.reset()
    q = torch.randn(3, H, P + R)
    eager, _ = absorption(q, rows)
    ab.reset_calls()
    with torch.no_grad():
        got, q_pe = torch.compile(absorption, fullgraph=True)(q, rows)
    assert sum(ab.calls().values()) == 1
    assert got.stride() == (H * (L + R), L + R, 1)
    # the same op on the same inputs: fp32 sums in the same order
    assert torch.equal(got, eager)
    assert qf.is_row_query(got, q_pe.contiguous())


def test_custom_ops_take_the_fixed_path_and_row_width():
    w = weight("bf16", torch.float32, path="torch")
    q_nope, _, _ = decode_query(2, torch.float32)
    a = q_nope.transpose(0, 1)
    got = torch.ops.vllm_mla.absorbed_bmm(a, w._values, None, "W_UK_T", "torch", L + R)
    assert got.shape == (H, 2, L) and got.stride() == (L + R, H * (L + R), 1)
    assert torch.equal(got, torch.bmm(a, w._values))
    assert ab.calls() == {"torch:W_UK_T": 1}
    with pytest.raises(ValueError, match="cannot serve"):
        AbsorbedWeight(w._values, None, torch.float32, "W_UK_T", path="triton")
    with pytest.raises(ValueError, match="row_width"):
        AbsorbedWeight(w._values, None, torch.float32, "W_UK_T", row_width=L - 1)


def test_parameter_copies_keep_path_rows_and_fusion():
    w = weight("bf16", path="torch")
    rows = nn.Parameter(w.rebound(row_width=L + R), requires_grad=False)
    f = fused(rows)
    assert rows.path == "torch" and rows.fusion is f
    kept = rows.detach()
    assert kept.path == "torch" and kept.row_width == L + R and kept.fusion is f
    names, ctx = rows.__tensor_flatten__()
    again = AbsorbedWeight.__tensor_unflatten__(
        {n: getattr(rows, n) for n in names}, ctx, rows.shape, rows.stride()
    )
    assert again.path == "torch" and again.row_width == L + R


def test_torch_path_fp8_is_the_staged_rule():
    """Off the kernel the FP8 consumer quantizes the staged values (the weight's own bmm,
    then cat) with the op's rule, e4m3(clamp(x / q_scale, -448, 448)): equal codes."""
    w = weight("bf16")
    f = fused(w, kernel=False)
    q_nope, q_pe, ql = decode_query(3)
    scale = torch.tensor(0.1)
    qf.arm(f)
    forward_impl_bmm(q_nope, w, ql)
    got = qf.project_fp8(ql, q_pe, scale)
    assert qf.calls() == {"concat_quant_fp8:torch": 1}
    qf.disarm()
    forward_impl_bmm(q_nope, w, ql)
    full = torch.cat([ql, q_pe], -1).float()
    want = (full / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
