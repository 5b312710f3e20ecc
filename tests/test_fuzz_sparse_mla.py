"""Fuzz properties of sparse_mla_forward (the harness, budgets and rules: tests/fuzz.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from error_bounds import sparse_mla_bound
from fuzz import (
    BF16,
    DEVICES,
    F32,
    FUZZ,
    TRITON_DEVICES,
    Layout,
    Placed,
    assert_refused,
    layout,
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

from vllm_mla.ops import sparse_mla as sm
from vllm_mla.ops.sparse_mla import (
    KV_FORMATS,
    SparseMLAError,
    SparseMLATypeError,
    sparse_mla_forward,
    sparse_mla_reference,
)


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
        "q_pe heads": ({"q": (c.q_nope, resized(c.q_pe, 1))}, err, "q_pe: expected shape"),
        "q_pe dtype": (
            {"q": (c.q_nope, c.q_pe.to(F32 if c.q_pe.dtype == BF16 else BF16))},
            terr,
            "q_pe: expected dtype",
        ),
        "q_nope strided": ({"q": (wider_last(c.q_nope), c.q_pe)}, err, "q_nope: last dim"),
        "kv_format name": ({"kv_format": "fp8"}, err, "kv_format: expected one of"),
        "kv_cache dtype": ({"kv_cache": cache.view(torch.int8)}, terr, "kv_cache: format"),
        "kv_cache width": ({"kv_cache": cache[..., 1:]}, err, "kv_cache: format"),
        "kv_cache strided": ({"kv_cache": wider_last(cache)}, err, "kv_cache: last dim"),
        "kv_cache empty": ({"kv_cache": cache[:0]}, err, "kv_cache: expected a non-empty"),
        "kv_cache object": ({"kv_cache": object()}, terr, "kv_cache: expected a Tensor"),
        "kv_cache device": ({"kv_cache": cache.to(other)}, err, "kv_cache: expected device"),
        "indices int64": ({"indices": c.indices.long()}, terr, "indices: expected dtype"),
        "indices tokens": ({"indices": resized(c.indices, 0)}, err, "indices: expected shape"),
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
            {"out": wider_last(zeros(t, h, 512, dtype=q.dtype))},
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
        table["indices strided"] = ({"indices": wider_last(c.indices)}, err, "indices: last")
    if h >= 2:
        table["lse strided"] = ({"lse": wider_last(zeros(t, h))}, err, "lse: last dim")
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
