"""Fuzz properties of the bugs this fuzzing found, each property the test of its fix.

The harness, budgets and rules: tests/fuzz.py.
"""

from __future__ import annotations

import pytest
import torch
from fuzz import (
    BF16,
    FUZZ,
    TRITON_DEVICES,
    assert_gemm_close,
    assert_refused,
    devices,
    needs_triton,
    other_device,
    randn,
    seeds,
)
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_query_bmm import bmm_calls
from test_fuzz_query_projection import (
    _pair,
    _replace,
    assert_projection_correct,
    projection_calls,
)
from test_fuzz_sparse_mla import run_sparse, sparse_calls

from vllm_mla.ops import (
    AbsorbedBmmError,
    MXFP8Weight,
    absorbed_bmm,
    mla_query_projection,
    safe_mla_query_bmm,
)
from vllm_mla.ops import absorbed_matmul as ab
from vllm_mla.ops import sparse_indexer as ix
from vllm_mla.ops.sparse_indexer import IndexerError
from vllm_mla.ops.sparse_mla import (
    SparseMLAError,
    sparse_mla_forward,
)
from vllm_mla.quant import FP8BlockTensor, MXFP8Tensor, fp8_block, mxfp8


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
# ZeroDivisionError under TRITON_INTERPRET=1 (absorbed_matmul.kernel.tiles: block_n =
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
