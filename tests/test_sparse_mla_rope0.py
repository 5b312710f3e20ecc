"""Sparse MLA without RoPE (qk_rope_head_dim 0, latent 512: GLM-5.3-Flash): the record
codecs, the contract, the reference against a float64 hand computation and the Triton
kernel (interpreted on CPU) against the reference, both cache formats, split and direct."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_mla.formats import FP8_DS_MLA_RECORD, LATENT
from vllm_mla.ops.sparse_mla import (
    KV_FORMATS,
    SparseMLAError,
    b12x_runner,
    pack_rows,
    record_bytes,
    record_width,
    sparse_mla_forward,
    sparse_mla_reference,
    unpack_rows,
)
from vllm_mla.ops.sparse_mla.formats import FORMAT, unpack_records
from vllm_mla.ops.sparse_mla.validate import validate

pytest.importorskip("triton")
from error_bounds import sparse_mla_bound

from vllm_mla.ops.sparse_mla import triton_kernels as kernels

SCALE = 1 / math.sqrt(LATENT)  # a NoPE model's qk head dim is the latent


def no_rope(n: int) -> torch.Tensor:
    return torch.empty(n, 0)


def make_cache(fmt, num_blocks=5, block_size=16, *, seed=0, rope_slot=0xFF):
    """A rope-0 cache whose pages interleave with a poisoned neighbour page (a stray read
    turns the result into NaN) and, for fp8_ds_mla, whose rope slots hold NaN bf16 bytes
    (``rope_slot``): vLLM's writer leaves them untouched, so the kernels must not read them.
    Binary-grid values as tests/test_sparse_mla.py's: every dot exact in fp32."""
    gen = torch.Generator().manual_seed(seed)
    n = num_blocks * block_size
    kv_c = grid_rows(fmt, n, gen)
    kv_c *= torch.exp2(torch.randint(-2, 2, (n, 1), generator=gen).float())
    packed = pack_rows(kv_c, no_rope(n), fmt)
    width = packed.shape[1]
    slot = FORMAT[fmt].rope_slot
    if slot is not None:  # a fixed-width record: its unread RoPE slot poisoned
        packed[:, slot[0] : slot[1]] = rope_slot
        big = torch.full((num_blocks, 2, block_size, width), 0xFF, dtype=torch.uint8)
    else:
        big = torch.full((num_blocks, 2, block_size, width), float("nan"), dtype=torch.bfloat16)
    big[:, 0] = packed.view(num_blocks, block_size, -1)
    return big[:, 0]


def grid_rows(fmt, n, gen):
    """Rows every codec stores exactly: eighths with each fp8 128-group's amax 7/8 (a
    power-of-two scale); for nvfp4, e2m1 values / 8 with each 16-block's amax 6/8 (scale
    1/8, an e4m3 value)."""
    if FORMAT[fmt].reader == "nvfp4":
        e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -3.0, -6.0])
        kv_c = e2m1[torch.randint(0, 12, (n, LATENT), generator=gen)] / 8
        kv_c[:, ::16] = 6 / 8
        return kv_c
    kv_c = torch.randint(-7, 8, (n, LATENT), generator=gen) / 8
    kv_c[:, ::128] = 7 / 8
    return kv_c


def make_q(t, h, *, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed + 2)
    return (torch.randint(-8, 9, (t, h, LATENT), generator=gen) / 4).to(dtype)  # quarters


def make_indices(t, k, num_rows, *, seed=0):
    gen = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, num_rows, (t, k), generator=gen, dtype=torch.int32)
    idx[0, 0] = num_rows - 1
    idx[torch.rand(t, k, generator=gen) < 0.2] = -1
    return idx


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    _, exponent = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8)


# --- codecs -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_record_geometry_and_round_trip(fmt):
    """rope 0: fp8_ds_mla and nvfp4_ds_mla keep their 656- and 352-byte records (vLLM
    sizes the page by the format), bf16 is kv_c alone (512 wide); values on each codec's
    grid round-trip exactly, and k_pe comes back 0 wide. rope 64 is unchanged."""
    slot = FORMAT[fmt].rope_slot
    want = {"fp8_ds_mla": FP8_DS_MLA_RECORD, "nvfp4_ds_mla": 352, "bf16": LATENT}[fmt]
    assert record_width(fmt, 0)[0] == want
    assert record_bytes(fmt, 0) == (want if slot else 2 * LATENT)
    assert record_width(fmt) == record_width(fmt, 64)
    kv_c = grid_rows(fmt, 6, torch.Generator().manual_seed(0))
    rec = pack_rows(kv_c, no_rope(6), fmt)
    assert rec.shape == (6, want)
    got_c, got_pe = unpack_records(rec, fmt, 0)
    assert torch.equal(got_c, kv_c) and got_pe.shape == (6, 0)
    if slot is not None:
        assert (rec[:, slot[0] : slot[1]] == 0).all()  # packed zero, never uninitialised
        rec[:, slot[0] : slot[1]] = 0xFF  # what the page held: not read back
        assert torch.equal(unpack_records(rec, fmt, 0)[0], kv_c)
    cache = rec.view(2, 3, -1)
    c2, pe2 = unpack_rows(cache, torch.tensor([[5, 0]]), fmt, 0)
    assert torch.equal(c2[0], kv_c[[5, 0]]) and pe2.shape == (1, 2, 0)


def test_codecs_refuse_other_rope_widths():
    with pytest.raises(SparseMLAError, match="rope"):
        record_width("bf16", 32)
    with pytest.raises(SparseMLAError, match=r"k_pe: expected \[N, 64\]"):
        pack_rows(torch.zeros(2, LATENT), torch.zeros(2, 32), "bf16")
    with pytest.raises(SparseMLAError, match="rope"):
        unpack_records(torch.zeros(2, LATENT, dtype=torch.bfloat16), "bf16", 32)


# --- contract ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q, cache_rope, match",
    [
        ("q576", 0, r"kv_cache: format bf16 expects \[num_blocks, block_size, 576\]"),
        ("q512", 64, r"kv_cache: format bf16 expects \[num_blocks, block_size, 512\]"),
        ("pe32", 0, r"q_pe: expected shape \[2, 2, 64\]"),
        ("q544", 0, r"q: expected shape \[\*, \*, 576\]"),
    ],
)
def test_query_and_cache_rope_must_agree(q, cache_rope, match):
    cache = pack_rows(torch.zeros(8, LATENT), torch.zeros(8, cache_rope), "bf16").view(2, 4, -1)
    queries = {
        "q576": torch.zeros(2, 2, LATENT + 64, dtype=torch.bfloat16),
        "q512": torch.zeros(2, 2, LATENT, dtype=torch.bfloat16),
        "pe32": (torch.zeros(2, 2, LATENT), torch.zeros(2, 2, 32)),
        "q544": torch.zeros(2, 2, LATENT + 32, dtype=torch.bfloat16),
    }
    idx = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(SparseMLAError, match=match):
        validate(queries[q], cache, idx, kv_format="bf16")  # the contract every impl runs


def test_fp8_cache_serves_both_ropes_by_the_query():
    """The fp8_ds_mla record is 656 bytes for both: the query's width says which."""
    cache = make_cache("fp8_ds_mla", rope_slot=0)
    idx = make_indices(2, 8, cache.shape[0] * cache.shape[1])
    q = make_q(2, 2, dtype=torch.float32)
    ref0, _ = sparse_mla_reference(q, cache, idx, SCALE, kv_format="fp8_ds_mla")
    q64 = torch.cat([q, torch.ones(2, 2, 64)], -1)  # the zero rope slot adds nothing
    ref64, _ = sparse_mla_reference(q64, cache, idx, SCALE, kv_format="fp8_ds_mla")
    assert torch.equal(ref0, ref64)


def test_b12x_declines_rope_0():
    q = torch.zeros(1, 2, LATENT, dtype=torch.bfloat16)
    reason = b12x_runner.unserved_reason(q, "fp8_ds_mla", SCALE, None, None, 0)
    assert reason is not None and "qk_rope_head_dim 0" in reason
    assert b12x_runner.unserved_reason(q, "fp8_ds_mla", SCALE, None, None, 64) is None


# --- reference vs float64 ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_reference_against_float64_hand_computation(fmt):
    """scores = scale * q . kv_c (no RoPE term), softmax over the valid indices (duplicates
    twice, -1 and past-lengths ignored), out = weights @ kv_c, in float64 on the decoded
    rows; the fp8 rope slot holds NaN and must not matter."""
    cache = make_cache(fmt, num_blocks=2, block_size=4)
    q = make_q(1, 3, dtype=torch.float32)
    idx = torch.tensor([[3, -1, 5, 3, 7, 0]], dtype=torch.int32)
    lengths = torch.tensor([5], dtype=torch.int32)
    out, lse = sparse_mla_reference(q, cache, idx, 0.1, kv_format=fmt, lengths=lengths)
    rows = unpack_rows(cache, torch.tensor([3, 5, 3, 7]), fmt, 0)[0].double()
    s = q[0].double() @ rows.T * 0.1
    # one side (the reference, fp32) against the exact result: sparse_mla_bound, sides=1
    out_tol, lse_tol = sparse_mla_bound(q, cache, idx, 0.1, fmt, lengths, sides=1)
    assert ((lse[0].double() - torch.logsumexp(s, -1)).abs() <= lse_tol[0]).all()
    assert ((out[0].double() - torch.softmax(s, -1) @ rows).abs() <= out_tol[0]).all()


# --- Triton (interpreter) vs reference --------------------------------------------------


def assert_matches(out, lse, ref, ref_lse, bound):
    """Interpreter dots are fp32: out within ``sparse_mla_bound`` (two fp32 summation
    orders, any CPU) plus one bf16 ulp (each side rounds once to bf16, <= half an ulp
    each), lse within its bound; empty rows exactly (0, -inf)."""
    out_tol, lse_tol = bound
    got, want = out.double(), ref.double()
    assert not got.isnan().any()
    tol = out_tol + bf16_ulp(torch.maximum(got.abs(), want.abs()))
    assert ((got - want).abs() <= tol).all(), ((got - want).abs() - tol).max()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert ((lse[finite].double() - ref_lse[finite]).abs() <= lse_tol[finite]).all()


@pytest.mark.parametrize("fmt", KV_FORMATS)
@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("tuple_q", [False, True])
def test_triton_matches_reference(fmt, direct, tuple_q, monkeypatch):
    """Split-K (3 splits) and direct (one split, several chunks); q as ``[T, H, 512]`` or
    ``(q_nope, q_pe [T, H, 0])`` (what vLLM's MLAAttention hands over at rope 0)."""
    if direct:
        monkeypatch.setattr(kernels, "TARGET_PROGRAMS", 1)
        monkeypatch.setattr(kernels, "_sites", {})
    cache = make_cache(fmt)
    t, h, k = 5, 3, 70
    plan = kernels.split_plan(t, h, k)
    assert plan.direct == direct and (direct or plan.num_splits == 3)
    idx = make_indices(t, k, cache.shape[0] * cache.shape[1], seed=h)
    lengths = torch.tensor([70, 33, 0, 1, 500], dtype=torch.int32)
    q = make_q(t, h, seed=h)
    if tuple_q:
        q = (q, q.new_empty(t, h, 0))
    out, lse = sparse_mla_forward(
        q, cache, idx, SCALE, kv_format=fmt, lengths=lengths, return_lse=True, impl="triton"
    )
    ref, ref_lse = sparse_mla_reference(q, cache, idx, SCALE, kv_format=fmt, lengths=lengths)
    bound = sparse_mla_bound(q, cache, idx, SCALE, fmt, lengths)
    assert_matches(out, lse, ref, ref_lse, bound)
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()


def test_rope_0_is_its_own_variant_and_site():
    """A rope-0 call compiles its own variant (ROPE=0) and a site refuses a query of the
    other width; rope-64 variant keys are unchanged (no rope entry)."""
    cache = make_cache("bf16")
    site0 = kernels.site_for(cache, 2, 8, "bf16", SCALE, torch.bfloat16, rope=0)
    assert site0.rope == 0 and site0.fixed[-1] == 0
    cache64 = pack_rows(torch.zeros(8, LATENT), torch.zeros(8, 64), "bf16").view(2, 4, -1)
    site64 = kernels.site_for(cache64, 2, 8, "bf16", SCALE, torch.bfloat16)
    assert site64.rope == 64 and len(site64.fixed) == 4
    q = make_q(1, 2)
    idx = torch.full((1, 8), -1, dtype=torch.int32)
    out = torch.empty(1, 2, LATENT, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="qk_rope_head_dim 0"):
        site0.launch(q, torch.zeros(1, 2, 64, dtype=torch.bfloat16), cache, idx, out, None)


# --- preparation: a plan declares rope 0 ------------------------------------------------


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_a_bound_call_with_rope_0(fmt, monkeypatch):
    """``SparseMLACaps(rope=0)``: the probes launch the ROPE=0 variants, so after freeze a
    bound call (physical rows, and logical rows through a block table, as the backend's)
    compiles nothing and matches the reference; a rope-64 query is refused by name."""
    from vllm_mla.ops.sparse_mla.preparation import PreparationSession, SparseMLACaps

    monkeypatch.setattr(kernels, "_compiled", set())
    h, k = 3, 40
    caps = SparseMLACaps(max_tokens=4, num_heads=h, topk=k, kv_format=fmt, rope=0)
    session = PreparationSession("cpu")
    plan = session.plan(caps, impl="triton")
    session.prepare(plan)
    session.freeze()
    cache = make_cache(fmt, num_blocks=2, block_size=64)
    call = session.bound_call(plan, softmax_scale=SCALE)
    q = make_q(4, h)
    q_pe = q.new_empty(4, h, 0)
    idx = make_indices(4, k, 128)
    ref, _ = sparse_mla_reference(q, cache, idx, SCALE, kv_format=fmt)
    out_tol, _ = sparse_mla_bound(q, cache, idx, SCALE, fmt)
    # bound: two fp32 orders (sparse_mla_bound) + one bf16 ulp (each side rounds once)
    tol = out_tol + bf16_ulp(ref)
    out = call.run(q, q_pe, cache, idx)  # physical rows; compiles nothing after freeze
    assert ((out.double() - ref.double()).abs() <= tol).all()
    block_table = torch.tensor([[1, 0]], dtype=torch.int32)  # logical p -> page 1 - p // 64
    logical = torch.where(idx >= 0, (idx + 64) % 128, idx)
    req_id = torch.zeros(4, dtype=torch.int32)
    out2 = call.run(q, q_pe, cache, logical, req_id, block_table)
    assert torch.equal(out2, out)
    # bf16: the 512-wide cache is not a rope-64 cache; fp8 (656 bytes for both): the plan
    with pytest.raises(ValueError, match=r"rope=0|block_size, 576\]"):
        call.run(q, torch.zeros(4, h, 64, dtype=q.dtype), cache, idx)
    with pytest.raises(ValueError, match=r"SparseMLACaps\.rope"):
        SparseMLACaps(max_tokens=4, num_heads=h, topk=k, rope=32)


def test_prewarm_at_rope_0_prepares_the_rope_0_variant(monkeypatch):
    """``prewarm(rope=0)`` compiles what a rope-0 call needs, so the call under capture
    compiles nothing; the rope-64 prewarm does not (another variant, refused by name)."""
    from vllm_mla.ops import sparse_mla as sm
    from vllm_mla.ops.sparse_mla import SparseMLANotPrepared

    monkeypatch.setattr(kernels, "_compiled", set())
    cache = make_cache("fp8_ds_mla")
    common = {"num_heads": 2, "topk": 40, "kv_format": "fp8_ds_mla", "impl": "triton"}
    idx = make_indices(2, 40, cache.shape[0] * cache.shape[1])

    def call():
        sparse_mla_forward(make_q(2, 2), cache, idx, SCALE, kv_format="fp8_ds_mla", impl="triton")

    assert sm.prewarm(cache, token_counts=[2], **common) == 1  # rope 64: not this call's
    monkeypatch.setattr(kernels, "capturing", lambda device: True)
    with pytest.raises(SparseMLANotPrepared):
        call()
    monkeypatch.setattr(kernels, "capturing", lambda device: False)
    assert sm.prewarm(cache, token_counts=[2], rope=0, **common) == 1
    monkeypatch.setattr(kernels, "capturing", lambda device: True)
    call()
    with pytest.raises(SparseMLAError, match="qk_rope_head_dim"):
        sm.prewarm(cache, token_counts=[2], rope=32, **common)
