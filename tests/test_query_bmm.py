"""safe_mla_query_bmm on CPU: torch.bmm results, boundary validation, custom-op plumbing."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vllm_mla.ops import query_bmm
from vllm_mla.ops.query_bmm import custom_op as query_bmm_op
from vllm_mla.ops.query_bmm import safe_mla_query_bmm

R = 64  # rope part of the decode q; the op reads only the nope part
BF16 = torch.bfloat16


def decode_query(t: int, h: int, q: int, gen: torch.Generator, offset: int = 0) -> torch.Tensor:
    """``q[..., :Q].transpose(0, 1)`` of a ``[T, H, Q + R]`` tensor: strides (Q+R, H(Q+R), 1)."""
    flat = torch.randn(offset + t * h * (q + R), generator=gen).to(BF16)
    return flat[offset:].view(t, h, q + R)[..., :q].transpose(0, 1)


def transposed_out(h: int, t: int, latent: int, offset: int = 0) -> torch.Tensor:
    """A NaN-filled ``[H, T, L]`` view of a ``[T, H, L]`` buffer (vLLM's layout)."""
    flat = torch.full((offset + t * h * latent,), float("nan"), dtype=BF16)
    return flat[offset:].view(t, h, latent).transpose(0, 1)


def operands(h=2, t=3, q=16, latent=24):
    gen = torch.Generator().manual_seed(0)
    query = decode_query(t, h, q, gen)
    weight = torch.randn(h, q, latent, generator=gen).to(BF16)
    return query, weight, transposed_out(h, t, latent)


def assert_is_the_product(out, query, weight):
    """``out`` is ``query @ weight`` by an independent fp64 reference: bf16 products are
    exact in fp32, the fp32 sum of K terms in any order is within K * 2**-24 of
    sum|terms| (``tests/error_bounds.py``), and the result is rounded once to bf16 (half
    an ulp; one ulp covers the reference's own rounding too). On CPU the op is torch.bmm
    on the views, so it must also equal torch.bmm exactly (the CPU contract)."""
    want = torch.bmm(query.double(), weight.double())
    terms = torch.bmm(query.double().abs(), weight.double().abs())
    _, exp = torch.frexp(want.abs().float())
    ulp = torch.ldexp(torch.ones_like(want), exp.double() - 8)
    tol = ulp + query.shape[-1] * 2.0**-24 * terms
    assert ((out.double() - want).abs() <= tol).all()
    if out.device.type == "cpu":
        assert torch.equal(out, torch.bmm(query, weight))


@pytest.mark.parametrize("q", [128, 192])
@pytest.mark.parametrize("t", [1, 5, 32])
@pytest.mark.parametrize("h", [1, 8, 11, 16])
def test_matches_bmm_on_decode_views(h, t, q):
    gen = torch.Generator().manual_seed(h * 1000 + t * 10 + q)
    query = decode_query(t, h, q, gen)
    weight = torch.randn(h, q, 512, generator=gen).to(BF16)
    out = transposed_out(h, t, 512)
    assert safe_mla_query_bmm(query, weight, out) is out
    assert_is_the_product(out, query, weight)


@pytest.mark.parametrize(("h", "t", "q", "latent"), [(3, 7, 40, 48), (1, 1, 1, 1), (5, 2, 17, 3)])
def test_odd_sizes_strided_weight_and_large_offsets(h, t, q, latent):
    gen = torch.Generator().manual_seed(1)
    query = decode_query(t, h, q, gen, offset=1_000_003)
    # W_UK_T-like: a [:, :Q] view of a bigger pack, so the weight's head stride is not Q * L.
    weight = torch.randn(h, q + 9, latent, generator=gen).to(BF16)[:, :q]
    out = transposed_out(h, t, latent, offset=777_777)
    safe_mla_query_bmm(query, weight, out)
    assert_is_the_product(out, query, weight)


def test_contiguous_operands():
    gen = torch.Generator().manual_seed(2)
    query = torch.randn(4, 6, 32, generator=gen).to(BF16)
    weight = torch.randn(4, 32, 8, generator=gen).to(BF16)
    out = torch.empty(4, 6, 8, dtype=BF16)
    safe_mla_query_bmm(query, weight, out)
    assert torch.equal(out, torch.bmm(query, weight))


def test_size_one_last_dim_may_have_any_stride():
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 3, 5, generator=gen).to(BF16)[..., 2:3]  # [2, 3, 1], last stride 1
    query = query.as_strided(query.shape, (15, 5, 7))  # stride 7 on a size-1 dim: still fine
    weight = torch.randn(2, 1, 4, generator=gen).to(BF16)
    out = torch.empty(2, 3, 4, dtype=BF16)
    safe_mla_query_bmm(query, weight, out)
    assert torch.equal(out, torch.bmm(query, weight))


# --- validation -------------------------------------------------------------------------------

ARGS = ("query", "weight", "out")


def replaced(name: str, value):
    args = dict(zip(ARGS, operands(), strict=True))
    args[name] = value(args[name])
    return args


@pytest.mark.parametrize("name", ARGS)
def test_wrong_dtype_names_the_argument(name):
    args = replaced(name, lambda t: t.float())
    with pytest.raises(TypeError, match=rf"{name} must be torch\.bfloat16, got torch\.float32"):
        safe_mla_query_bmm(**args)


@pytest.mark.parametrize("name", ARGS)
def test_not_a_tensor_names_the_argument(name):
    args = replaced(name, lambda t: t.tolist())
    with pytest.raises(TypeError, match=rf"{name} must be a torch\.Tensor"):
        safe_mla_query_bmm(**args)


@pytest.mark.parametrize("name", ARGS)
def test_wrong_rank_names_the_argument(name):
    args = replaced(name, lambda t: t[0])
    with pytest.raises(ValueError, match=rf"{name} must be 3-D \[H, .*got shape"):
        safe_mla_query_bmm(**args)


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        ("weight", (3, 16, 24), r"weight\.shape\[0\] \(H\) is 3 but query has H = 2"),
        ("weight", (2, 15, 24), r"weight\.shape\[1\] \(Q\) is 15 but query has Q = 16"),
        ("out", (3, 3, 24), r"out\.shape\[0\] \(H\) is 3 but query has H = 2"),
        ("out", (2, 4, 24), r"out\.shape\[1\] \(T\) is 4 but query has T = 3"),
        ("out", (2, 3, 25), r"out\.shape\[2\] \(L\) is 25 but weight has L = 24"),
    ],
)
def test_mismatched_sizes_name_the_argument(name, shape, message):
    args = replaced(name, lambda t: torch.empty(shape, dtype=BF16))
    with pytest.raises(ValueError, match=message) as info:
        safe_mla_query_bmm(**args)
    assert "expected query [H, T, Q] x weight [H, Q, L] -> out [H, T, L]" in str(info.value)


@pytest.mark.parametrize("name", ARGS)
def test_non_contiguous_last_dim_names_the_argument(name):
    args = replaced(name, lambda t: torch.empty(*t.shape[:2], t.shape[2] * 2, dtype=BF16)[..., ::2])
    with pytest.raises(ValueError, match=rf"{name}'s last dim must be contiguous.*strides"):
        safe_mla_query_bmm(**args)


@pytest.mark.parametrize("name", ["weight", "out"])
def test_device_mismatch_names_the_argument(name):
    args = replaced(name, lambda t: torch.empty(t.shape, dtype=BF16, device="meta"))
    with pytest.raises(ValueError, match=rf"{name} is on meta but query is on cpu"):
        safe_mla_query_bmm(**args)


def test_out_overlapping_query_is_refused():
    buf = torch.zeros(2, 3, 24, dtype=BF16)
    query = buf[..., :16]
    weight = torch.zeros(2, 16, 24, dtype=BF16)
    with pytest.raises(ValueError, match="out overlaps query"):
        safe_mla_query_bmm(query, weight, buf)


def test_out_overlapping_weight_is_refused():
    query, _, _ = operands()
    weight = torch.zeros(2, 16, 24, dtype=BF16)
    out = weight[:, 5:8]  # [2, 3, 24] inside the weight
    with pytest.raises(ValueError, match="out overlaps weight"):
        safe_mla_query_bmm(query, weight, out)


def test_out_with_a_stride_0_dim_is_refused():
    query, weight, _ = operands()
    out = torch.empty(2, 1, 24, dtype=BF16).expand(2, 3, 24)  # torch.bmm raises untyped here
    with pytest.raises(ValueError, match="out has elements that share memory"):
        safe_mla_query_bmm(query, weight, out)


def test_adjacent_buffers_do_not_count_as_overlap():
    buf = torch.zeros(2 * 3 * 16 + 2 * 3 * 24, dtype=BF16)
    query = buf[: 2 * 3 * 16].view(2, 3, 16)
    out = buf[2 * 3 * 16 :].view(2, 3, 24)
    weight = torch.ones(2, 16, 24, dtype=BF16)
    safe_mla_query_bmm(query, weight, out)
    assert torch.equal(out, torch.bmm(query, weight))


# --- custom-op plumbing -----------------------------------------------------------------------


def test_op_schema():
    schema = torch.ops.vllm_mla.safe_mla_query_bmm.default._schema
    assert str(schema) == (
        "vllm_mla::safe_mla_query_bmm(Tensor query, Tensor weight, Tensor(a!) out) -> ()"
    )


def test_opcheck_on_decode_views():
    query, weight, out = operands(h=4, t=5, q=32, latent=40)
    torch.library.opcheck(torch.ops.vllm_mla.safe_mla_query_bmm, (query, weight, out))


# torch.compile's own imports use torch.jit.script_method, deprecated inside torch itself.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile_fullgraph():
    query, weight, out = operands(h=4, t=5, q=32, latent=40)

    @torch.compile(fullgraph=True, dynamic=False)
    def step(q, w, o):
        return safe_mla_query_bmm(q, w, o) * 2

    result = step(query, weight, out)
    assert torch.equal(out, torch.bmm(query, weight))
    assert torch.equal(result, out * 2)


def test_fake_impl_keeps_out_metadata():
    query, weight, out = operands(h=4, t=5, q=32, latent=40)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fq, fw, fo = (mode.from_tensor(x) for x in (query, weight, out))
        assert torch.ops.vllm_mla.safe_mla_query_bmm(fq, fw, fo) is None
        got = safe_mla_query_bmm(fq, fw, fo)  # the overlap check must not touch fake memory
    assert got is fo
    assert (got.shape, got.stride(), got.dtype) == (out.shape, out.stride(), out.dtype)


def test_availability_is_consistent():
    assert query_bmm.cuda_op_available() == (query_bmm.cuda_op_error() is None)
    if torch.version.cuda is None:  # a CPU-only torch can never load the CUDA build
        assert not query_bmm.cuda_op_available()
        assert "vllm_mla._C" in query_bmm.cuda_op_error()


def test_sm12x_fallback_copies_and_logs_once(monkeypatch, caplog):
    """The CUDA fallback's SM12x branch, driven with CPU tensors."""
    monkeypatch.setattr(query_bmm_op, "_is_sm12x", lambda index: True)
    query_bmm_op._log_copy_path_once.cache_clear()
    copies = []
    real_contiguous = torch.Tensor.contiguous

    def spy(self, *args, **kwargs):
        copies.append(self.is_contiguous())
        return real_contiguous(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    query, weight, out = operands()
    with caplog.at_level(logging.WARNING, logger="vllm_mla"):
        for _ in range(2):
            query_bmm_op._cuda_fallback(query, weight, out)
    assert torch.equal(out, torch.bmm(query, weight))
    assert False in copies  # the strided query went through .contiguous()
    assert len(caplog.records) == 1
    assert "contiguous copy of the query" in caplog.records[0].getMessage()
    query_bmm_op._log_copy_path_once.cache_clear()
