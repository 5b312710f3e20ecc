"""``AbsorbedWeight``: unmodified ``torch.bmm`` code runs our op, eager and compiled, and the
weight survives what vLLM does to parameters (``nn.Parameter``, ``.data``, reload copies)."""

from __future__ import annotations

import pytest
import torch
from compile_support import needs_subclass_compile
from torch import nn

from vllm_mla.memory import Ledger
from vllm_mla.ops import absorbed_matmul as ab
from vllm_mla.ops.absorbed_matmul import AbsorbedBmmError, MXFP8Weight
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.quant import mxfp8

H, P, V, L = 3, 128, 64, 64


def pack(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return mxfp8.quantize(torch.randn(H * (P + V), L, generator=gen) * 0.05, axis=-1)


def mx_views(q):
    vals, codes = q.values.unflatten(0, (H, P + V)), q.scales.unflatten(0, (H, P + V))
    return {
        "W_UK_T": MXFP8Weight(vals[:, :P, :], codes[:, :P, :]),
        "W_UV": MXFP8Weight(vals[:, P:, :].transpose(1, 2), codes[:, P:, :].transpose(1, 2)),
    }


def routed(kind: str, role: str, dtype=torch.bfloat16, seed=0) -> nn.Parameter:
    view = mx_views(pack(seed))[role]
    if kind == "mxfp8":
        w = AbsorbedWeight.mxfp8(view, dtype, role)
    else:
        w = AbsorbedWeight.dense(ab.decode(view, dtype).contiguous(), role)
    return nn.Parameter(w, requires_grad=False)


def assert_fp32_order_close(got, want, a, weight):
    """``a @ weight`` from two kernels (Triton's interpreter or torch, any CPU blocking):
    each fp32 sum of K terms is within K * 2**-24 of sum|terms|, so they differ by at most
    K * 2**-23 of it; bf16 results add one ulp (each side rounds once, <= half an ulp)."""
    w = ab.decode(weight, torch.float32) if isinstance(weight, MXFP8Weight) else weight.float()
    terms = torch.bmm(a.float().abs(), w.abs())
    tol = a.shape[-1] * 2.0**-23 * terms
    if got.dtype == torch.bfloat16:
        _, exp = torch.frexp(torch.maximum(got.float().abs(), want.float().abs()))
        tol = tol + torch.ldexp(torch.ones_like(tol), exp - 8)  # 8 significant bits
    assert ((got.float() - want.float()).abs() <= tol).all()


def query(m=2, dtype=torch.bfloat16):
    """``q_nope`` as vLLM slices it: ``[M, H, P]`` view of a ``[M, H, P + R]`` tensor."""
    return torch.randn(m, H, P + 64).to(dtype)[..., :P]


@pytest.mark.parametrize("kind", ["dense", "mxfp8"])
def test_parameter_keeps_the_type_and_logical_metadata(kind):
    w = routed(kind, "W_UV")
    module = nn.Module()
    module.register_parameter("W_UV", w)
    assert isinstance(module.W_UV, AbsorbedWeight) and isinstance(module.W_UV, nn.Parameter)
    assert module.W_UV.shape == (H, L, V) and module.W_UV.dtype == torch.bfloat16
    assert module.W_UV.is_contiguous() and module.W_UV.stride(-1) == 1
    assert isinstance(w.data, AbsorbedWeight) and w.data.inner_tensors()[0] is w._values
    assert w.contiguous() is w
    assert "AbsorbedWeight(W_UV" in repr(w)


@pytest.mark.parametrize("kind", ["dense", "mxfp8"])
def test_eager_bmm_with_out_routes_to_the_op(kind):
    w = routed(kind, "W_UK_T")
    q = query()
    out = torch.empty(2, H, L, dtype=torch.bfloat16)
    ab.reset_calls()
    # MLAAttention.forward_impl: torch.bmm(mqa_q_nope, W_UK_T, out=mqa_ql_nope.transpose(0, 1))
    torch.bmm(q.transpose(0, 1), w, out=out.transpose(0, 1))
    assert sum(ab.calls().values()) == 1 and next(iter(ab.calls())).endswith(":W_UK_T")
    want = ab.absorbed_bmm_reference(q.transpose(0, 1), w.weight)
    assert_fp32_order_close(out.transpose(0, 1), want, q.transpose(0, 1), w.weight)


@pytest.mark.parametrize("kind", ["dense", "mxfp8"])
def test_eager_bmm_and_method_without_out(kind):
    w = routed(kind, "W_UV", torch.float32)
    x = torch.randn(H, 4, L)
    ab.reset_calls()
    a = torch.bmm(x, w)
    b = x.bmm(w)
    assert type(a) is torch.Tensor and torch.equal(a, b)
    assert sum(ab.calls().values()) == 2
    assert_fp32_order_close(a, ab.absorbed_bmm_reference(x, w.weight), x, w.weight)


def absorb(q_nope: torch.Tensor, w_uk_t: torch.Tensor) -> torch.Tensor:
    # DeepseekV32Attention.forward, inside vLLM's torch.compile'd region
    return torch.bmm(q_nope.transpose(0, 1), w_uk_t).transpose(0, 1)


def absorb_out(q_nope: torch.Tensor, w_uk_t: torch.Tensor) -> torch.Tensor:
    # dynamo refuses a non-contiguous out= for any tensor; vLLM's are in eager regions
    out = q_nope.new_empty((q_nope.shape[1], q_nope.shape[0], w_uk_t.shape[2]))
    torch.bmm(q_nope.transpose(0, 1), w_uk_t, out=out)
    return out.transpose(0, 1)


@needs_subclass_compile
@pytest.mark.parametrize("fn", [absorb, absorb_out], ids=["functional", "out"])
@pytest.mark.parametrize("kind", ["dense", "mxfp8"])
def test_compiled_fullgraph_runs_the_custom_op(kind, fn):
    torch._dynamo.reset()
    w = routed(kind, "W_UK_T", torch.float32)
    q = query(3, torch.float32)
    eager = fn(q, w)
    ab.reset_calls()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, w)
    assert sum(ab.calls().values()) == 1  # the op ran inside the compiled graph
    heads_first = (t.transpose(0, 1) for t in (compiled, eager, q))
    assert_fp32_order_close(*heads_first, w.weight)
    explained = torch._dynamo.explain(fn)(q, w)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


def test_dense_copy_writes_the_wrapped_storage():
    w = routed("dense", "W_UK_T")
    inner = w._values
    new = torch.randn(H, P, L).bfloat16()
    w.data.copy_(new)  # what vLLM's _copy_and_restore_kernel_tensors does
    assert w._values is inner and torch.equal(inner, new)


def test_mxfp8_copy_from_itself_is_a_noop_and_from_a_twin_refreshes():
    w = routed("mxfp8", "W_UV", seed=0)
    before = (w._values.clone(), w._scales.clone())
    w.data.copy_(w)
    assert torch.equal(w._values.view(torch.uint8), before[0].view(torch.uint8))
    twin = routed("mxfp8", "W_UV", seed=1)
    ptr = w._values.data_ptr()
    w.data.copy_(twin)
    assert w._values.data_ptr() == ptr
    assert torch.equal(ab.decode(w.weight, torch.float32), ab.decode(twin.weight, torch.float32))


def test_mxfp8_refuses_writes_it_cannot_represent():
    w = routed("mxfp8", "W_UK_T")
    with pytest.raises(TypeError, match="only another MXFP8 weight"):
        w.data.copy_(torch.zeros(H, P, L, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="read-only view of kv_b_proj's pack"):
        w.mul_(2)


def test_other_ops_see_the_decoded_values():
    w = routed("mxfp8", "W_UV")
    dense = ab.decode(w.weight, torch.bfloat16)
    assert torch.equal(w + 0, dense)
    assert torch.equal(w.float(), dense.float())
    assert torch.equal(w.dense_values(), dense)


def test_construction_validates_the_weight_once():
    view = mx_views(pack())["W_UK_T"]
    with pytest.raises(AbsorbedBmmError, match="fits neither"):
        AbsorbedWeight.mxfp8(MXFP8Weight(view.values, view.scales[..., :1]), torch.bfloat16)
    with pytest.raises(AbsorbedBmmError, match="an MXFP8 weight takes a in"):
        AbsorbedWeight.mxfp8(view, torch.float16)


def test_calls_that_do_not_fit_get_the_full_message():
    w = routed("mxfp8", "W_UK_T")
    with pytest.raises(AbsorbedBmmError, match="does not fit a"):
        torch.bmm(torch.randn(H, 2, P + 1).bfloat16(), w)
    with pytest.raises(AbsorbedBmmError, match=r"a must be torch\.bfloat16, got torch\.float32"):
        torch.bmm(torch.randn(H, 2, P), w)
    with pytest.raises(AbsorbedBmmError, match="out must be"):
        torch.bmm(query().transpose(0, 1), w, out=torch.empty(H, 2, L + 1, dtype=torch.bfloat16))


def test_flatten_round_trip():
    w = routed("mxfp8", "W_UV")
    names, ctx = w.__tensor_flatten__()
    back = AbsorbedWeight.__tensor_unflatten__({n: getattr(w, n) for n in names}, ctx, None, None)
    assert back.kind == "mxfp8" and back.role == "W_UV" and back.dtype == w.dtype
    assert back._values is w._values and back._scales is w._scales


def test_ledger_counts_the_wrapped_storage_once():
    q = pack()
    views = mx_views(q)
    layer = nn.Module()
    layer.kv_b_proj = nn.Module()
    layer.kv_b_proj.register_parameter("weight", nn.Parameter(q.values, requires_grad=False))
    layer.kv_b_proj.register_parameter("weight_scale", nn.Parameter(q.scales, requires_grad=False))
    for name, view in views.items():
        layer.register_parameter(
            name,
            nn.Parameter(AbsorbedWeight.mxfp8(view, torch.bfloat16, name), requires_grad=False),
        )
    row = Ledger().add_layer(layer)
    assert row["absorbed"] == q.values.nbytes + q.scales.nbytes  # the pack, once
    assert row["source"] == 0
