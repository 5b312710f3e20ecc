"""Triton DSA lightning indexer (interpreted on CPU) against the plain-torch reference."""

from __future__ import annotations

import pytest
import torch
from aot import assert_fits, compile_report

from vllm_mla.ops.sparse_indexer import reference as ref
from vllm_mla.ops.sparse_indexer.reference import RECORD_BYTES, IndexerError

pytest.importorskip("triton")
from vllm_mla.ops.sparse_indexer import api as tk
from vllm_mla.ops.sparse_indexer import triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pool(num_blocks, block_size):
    """(buffer, cache): the cache's pages interleave with a poisoned neighbour page (dim-0
    stride is two pages, as layers share one allocation): a stray read gives NaN (0xFF is
    an e4m3 NaN and a NaN float32 scale), a stray write shows in the buffer."""
    big = torch.full((num_blocks, 2, block_size, RECORD_BYTES), 0xFF, dtype=torch.uint8)
    big = big.to(DEVICE)
    cache = big[:, 1]
    assert cache.stride(0) == 2 * block_size * RECORD_BYTES
    return big, cache


def random_keys(n, *, seed, dtype=torch.bfloat16):
    """Rows over six decades of magnitude, one all-zero row (the amax floor)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 128, generator=gen) * torch.logspace(-4, 2, n)[:, None]
    k[n // 2] = 0
    return k.to(dtype).to(DEVICE)


def filled_cache(num_blocks, block_size, *, seed):
    _, cache = pool(num_blocks, block_size)
    n = num_blocks * block_size
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, 128, generator=gen) * torch.rand(n, 1, generator=gen) * 3
    ref.insert_keys(cache, keys.to(DEVICE), torch.arange(n, device=DEVICE))
    return cache


def block_tables(lengths, block_size, num_blocks, *, seed):
    """One row per token: a random permutation of the pool's pages (interleaved pages)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(lengths) // block_size))
    rows = [torch.randperm(num_blocks, generator=gen)[:width] for _ in lengths]
    return torch.stack(rows).to(torch.int32).to(DEVICE)


def reference_logits(q, w, cache, tables, length):
    """(reference logits of one token over its length, the tolerance bound per position)."""
    rows = ref.request_rows(tables, length, cache.shape[1])
    k, k_scale = ref.read_keys(cache, rows)
    want = ref.logits(q[None].float(), w[None], k, k_scale)[0]
    magnitude = ref.logits(q[None].float().abs(), w[None].abs(), k.float().abs(), k_scale)[0]
    return want, tk.LOGIT_RTOL * magnitude + tk.LOGIT_ATOL


# ---------------------------------------------------------------- insert


@pytest.mark.parametrize("ue8m0", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_insert_is_bit_exact_with_the_reference(ue8m0, dtype, slot_dtype):
    nb, bs, t = 5, 16, 37
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(nb * bs - 1, generator=gen)[:t]  # distinct: no write races
    slots[[0, 5, 11]] = torch.tensor([-1, -7, nb * bs - 1])  # skipped, skipped, last row
    slots = slots.to(slot_dtype).to(DEVICE)
    k = random_keys(t, seed=4, dtype=dtype)
    got_big, got = pool(nb, bs)
    want_big, want = pool(nb, bs)
    tk.insert_keys(got, k, slots, ue8m0=ue8m0)
    ref.insert_keys(want, k, slots, ue8m0=ue8m0)
    assert torch.equal(got_big, want_big)  # the neighbour pages untouched too


def test_insert_skips_slots_past_the_pool():
    big, cache = pool(2, 16)
    before = big.clone()
    slots = torch.tensor([32, 2**40], device=DEVICE)  # the reference would raise here
    tk.insert_keys(cache, random_keys(2, seed=0), slots)
    assert torch.equal(big, before)


def test_insert_matches_the_reference_scale_just_above_powers_of_two():
    """The reference's fp32 log2 rounds scales a few ulps above 2**e down to e (ue8m0
    then keeps 2**e); the kernel emulates that on the bits, for every exponent in use."""
    scales = torch.tensor([2.0**e for e in range(-23, 12)]).view(torch.int32)
    scales = (scales[:, None] + torch.arange(8)[None, :]).flatten().view(torch.float32)
    k = torch.zeros(len(scales), 128)
    k[:, 7] = -scales * 448  # amax / 448 lands on the scale (or next to it)
    k = k.to(DEVICE)
    slots = torch.arange(len(scales), device=DEVICE)
    got = torch.zeros(len(scales), 1, RECORD_BYTES, dtype=torch.uint8, device=DEVICE)
    want = got.clone()
    tk.insert_keys(got, k, slots)
    ref.insert_keys(want, k, slots)
    assert torch.equal(got, want)


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize("heads", [1, 4, 32, 64])  # 64: two head tiles
@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_logits_match_the_reference_within_the_tolerance(heads, q_dtype, block_size):
    nb = 320 // block_size
    cache = filled_cache(nb, block_size, seed=heads)
    lengths = [0, 1, 17, 63, 64, 65, 150]
    gen = torch.Generator().manual_seed(heads + 1)
    q = (torch.randn(len(lengths), heads, 128, generator=gen) * 4).to(q_dtype).to(DEVICE)
    w = (torch.randn(len(lengths), heads, generator=gen) * heads**-0.5).to(DEVICE)
    tables = block_tables(lengths, block_size, nb, seed=heads)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    s = 160  # not a multiple of the 64-key tile
    got = tk.paged_logits(q, w, cache, tables, lens, max_len=s)
    assert got.shape == (len(lengths), s) and got.dtype == torch.float32
    for t, length in enumerate(lengths):
        assert torch.isneginf(got[t, length:]).all()
        want, tol = reference_logits(q[t], w[t], cache, tables[t], length)
        err = (got[t, :length] - want).abs()
        assert bool((err <= tol).all()), (t, float((err - tol).max()))


def test_paged_logits_never_read_outside_the_pool_or_past_s():
    cache = filled_cache(4, 16, seed=0)
    q = torch.randn(3, 4, 128).to(torch.bfloat16).to(DEVICE)
    w = torch.rand(3, 4, device=DEVICE)
    tables = torch.tensor([[1, 9], [2, -1], [3, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([32, 32, 90], dtype=torch.int32, device=DEVICE)  # 90: past table, S
    out = torch.full((3, 40), 7.0, device=DEVICE)
    tk.paged_logits(q, w, cache, tables, lens, out=out)
    assert torch.isfinite(out[:, :16]).all()
    assert torch.isneginf(out[:2, 16:]).all()  # page 9 and -1: not in the pool
    assert torch.isfinite(out[2, 16:32]).all() and torch.isneginf(out[2, 32:]).all()


# ---------------------------------------------------------------- top-k


@pytest.mark.parametrize("topk", [8, 64, 256])
def test_select_topk_is_identical_to_the_reference_with_exact_ties(topk):
    gen = torch.Generator().manual_seed(topk)
    t, s = 9, 300
    scores = torch.randint(-3, 4, (t, s), generator=gen).float()  # exact ties everywhere
    scores[0, ::3] = -0.0  # ties with +0.0
    scores[1, :40] = float("-inf")  # valid -inf positions rank above the masked ones
    scores[2, 3::7] = float("nan")  # NaN ranks first, like torch.sort
    scores[3] = 1.5  # one value throughout
    scores[4] = torch.randn(s, generator=gen)
    lengths = torch.tensor([s, 200, 77, 5, 1, 0, -4, 64, 1000], dtype=torch.int32)
    got = tk.select_topk(scores.to(DEVICE), lengths.to(DEVICE), topk)
    assert got.dtype == torch.int32 and got.shape == (t, topk)
    assert torch.equal(got.cpu(), ref.select_topk(scores, lengths, topk))


def test_select_topk_pads_when_k_exceeds_the_context():
    scores = torch.randn(3, 5, device=DEVICE)
    lengths = torch.tensor([5, 3, 0], device=DEVICE)  # int64 lengths too
    got = tk.select_topk(scores, lengths, 64)
    assert torch.equal(got.cpu(), ref.select_topk(scores.cpu(), lengths.cpu(), 64))
    assert (got[0, 5:] == -1).all() and (got[1, 3:] == -1).all() and (got[2] == -1).all()
    assert sorted(got[0, :5].tolist()) == list(range(5))


def near_ties(scores, bounds, lengths, topk):
    """Adjacent unequal pairs in the reference order, up to rank min(K, L), closer than the
    two tolerances: the only places the selection may legitimately differ (equal pairs,
    the duplicated keys, are settled by the tie rule in both)."""
    count = 0
    for t, length in enumerate(lengths):
        ranked = torch.sort(scores[t], descending=True, stable=True)
        values, bound = ranked.values, bounds[t][ranked.indices]
        n = min(topk + 1, length)
        gap = values[: n - 1] - values[1:n]
        count += int(((gap > 0) & (gap <= bound[: n - 1] + bound[1:n])).sum())
    return count


@pytest.mark.parametrize("seed", [0, 2, 5])  # H = 4, 16, 32
def test_index_topk_is_identical_to_the_reference_on_random_cases(seed):
    """Random logits: a pair closer than the summed tolerances could swap, so such pairs are
    counted (random data with cancelling dots has some at deep ranks: K = 8 here, and the
    exact-logit test below covers large K); the seeds used have none."""
    gen = torch.Generator().manual_seed(seed)
    nb, bs, heads, topk = 8, 16, [4, 32, 16, 32][seed % 4], 8
    cache = filled_cache(nb, bs, seed=seed)
    # Duplicated keys: exact logit ties across pages, settled toward the lower position.
    dup = torch.randn(1, 128, generator=gen).expand(6, 128).to(DEVICE) * 9
    ref.insert_keys(cache, dup, torch.tensor([3, 20, 21, 70, 100, 127], device=DEVICE))
    lengths = [int(x) for x in torch.randint(0, nb * bs, (3,), generator=gen)] + [1, 0, 128]
    t = len(lengths)
    q = (torch.randn(t, heads, 128, generator=gen) * 3).to(torch.float8_e4m3fn).to(DEVICE)
    w = (torch.rand(t, heads, generator=gen) * heads**-0.5).to(DEVICE)
    tables = block_tables(lengths, bs, nb, seed=seed)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    got = tk.index_topk(q, w, cache, tables, lens, topk, max_len=nb * bs)
    want = ref.index_topk(q, w, cache, tables, lens, topk)
    scores, bounds = zip(
        *(reference_logits(q[i], w[i], cache, tables[i], lengths[i]) for i in range(t)),
        strict=True,
    )
    ties = near_ties(scores, bounds, lengths, topk)
    assert ties == 0, f"{ties} boundary near-ties on seed {seed}: choose another seed"
    assert torch.equal(got, want)


@pytest.mark.parametrize("topk", [8, 64, 256])
def test_index_topk_is_identical_to_the_reference_on_exact_logits(topk):
    """Integer keys and queries (|k| <= 8 times a power of two, |q| <= 4, weights in
    quarters): every product and partial sum is exact in fp32 in any order, so the logits
    are bit-equal and full of exact ties, and the selection must be identical at every K."""
    gen = torch.Generator().manual_seed(topk)
    nb, bs, heads = 20, 16, 32
    n = nb * bs
    keys = torch.randint(-8, 9, (n, 128), generator=gen).float()
    keys[:, 0] = 8  # amax 8 * 2**m: ue8m0 scale 2**(m - 5), values 32 k, exact
    keys *= torch.exp2(torch.randint(-6, 7, (n, 1), generator=gen).float())
    keys[torch.randperm(n, generator=gen)[:40]] = keys[7].clone()  # more exact ties
    _, cache = pool(nb, bs)
    ref.insert_keys(cache, keys.to(DEVICE), torch.arange(n, device=DEVICE))
    lengths = [int(x) for x in torch.randint(0, n, (4,), generator=gen)] + [n, 5, 1, 0]
    t = len(lengths)
    q = torch.randint(-4, 5, (t, heads, 128), generator=gen).to(torch.float8_e4m3fn)
    w = torch.randint(-1, 4, (t, heads), generator=gen).float() / 4
    q, w = q.to(DEVICE), w.to(DEVICE)
    tables = block_tables(lengths, bs, nb, seed=topk)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    scores = tk.paged_logits(q, w, cache, tables, lens, max_len=n)
    ties = 0
    for i, length in enumerate(lengths):
        want, _ = reference_logits(q[i], w[i], cache, tables[i], length)
        assert torch.equal(scores[i, :length], want)
        ties += length - len(torch.unique(want))
    assert ties > 100  # the tie rule is exercised
    got = tk.index_topk(q, w, cache, tables, lens, topk, max_len=n)
    assert torch.equal(got, ref.index_topk(q, w, cache, tables, lens, topk))


# ---------------------------------------------------------------- contract


def test_wrong_arguments_are_named():
    cache = filled_cache(2, 16, seed=0)
    q = torch.zeros(2, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    w = torch.zeros(2, 4, device=DEVICE)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(IndexerError, match="q: expected dtype in"):
        tk.paged_logits(q.float(), w, cache, tables, lens, max_len=8)
    with pytest.raises(IndexerError, match=r"weights: expected contiguous \(2, 4\)"):
        tk.paged_logits(q, w[:, :3], cache, tables, lens, max_len=8)
    with pytest.raises(IndexerError, match="block_tables: expected dtype int32"):
        tk.paged_logits(q, w, cache, tables.long(), lens, max_len=8)
    with pytest.raises(IndexerError, match=r"lengths: expected dtype torch\.int32"):
        tk.paged_logits(q, w, cache, tables, lens.long(), max_len=8)
    with pytest.raises(IndexerError, match="index-key cache: expected uint8"):
        tk.paged_logits(q, w, cache.view(torch.int8), tables, lens, max_len=8)
    with pytest.raises(IndexerError, match=r"k: expected shape \(3, 128\)"):
        tk.insert_keys(cache, torch.zeros(2, 128, device=DEVICE), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(IndexerError, match="slots: expected int32 or int64"):
        tk.insert_keys(cache, torch.zeros(2, 128, device=DEVICE), torch.zeros(2, device=DEVICE))
    with pytest.raises(IndexerError, match="topk: expected an int >= 1"):
        tk.select_topk(torch.zeros(2, 8, device=DEVICE), lens, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU only: the interpreter switch")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cache = filled_cache(1, 16, seed=0)
    with pytest.raises(NotImplementedError, match="TRITON_INTERPRET=1"):
        tk.insert_keys(cache, torch.zeros(1, 128), torch.zeros(1, dtype=torch.int32))


OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor")
OPCHECK_TESTS += ("test_aot_dispatch_dynamic",)


def test_custom_ops_pass_opcheck():
    cache = filled_cache(3, 16, seed=0)
    k = random_keys(4, seed=1)
    slots = torch.tensor([40, -1, 2, 17], device=DEVICE)
    torch.library.opcheck(
        torch.ops.vllm_mla.indexer_insert_keys, (cache, k, slots, True), test_utils=OPCHECK_TESTS
    )
    # bf16 q: opcheck's schema check multiplies inputs, not implemented for fp8 on CPU.
    q = torch.randn(2, 4, 128).to(torch.bfloat16).to(DEVICE)
    w = torch.rand(2, 4, device=DEVICE)
    tables = torch.tensor([[2, 0, 1], [1, 2, 0]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([40, 3], dtype=torch.int32, device=DEVICE)
    out = torch.empty(2, 48, device=DEVICE)
    args = (q, w, cache, tables, lens, out)
    torch.library.opcheck(torch.ops.vllm_mla.indexer_paged_logits, args, test_utils=OPCHECK_TESTS)
    picked = torch.empty(2, 8, dtype=torch.int32, device=DEVICE)
    torch.library.opcheck(
        torch.ops.vllm_mla.indexer_select_topk, (out, lens, picked), test_utils=OPCHECK_TESTS
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_index_topk_captures_and_replays_in_a_cuda_graph():
    nb, bs, t, heads, topk = 8, 64, 4, 32, 64
    cache = filled_cache(nb, bs, seed=0)
    q = torch.randn(t, heads, 128, device=DEVICE).to(torch.float8_e4m3fn)
    w = torch.rand(t, heads, device=DEVICE)
    tables = block_tables([nb * bs] * t, bs, nb, seed=0)
    lens = torch.tensor([1, 100, 300, nb * bs], dtype=torch.int32, device=DEVICE)
    out = torch.empty(t, topk, dtype=torch.int32, device=DEVICE)
    tk.index_topk(q, w, cache, tables, lens, topk, max_len=nb * bs, out=out)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.index_topk(q, w, cache, tables, lens, topk, max_len=nb * bs, out=out)
    for seed in (1, 2):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        q.copy_(torch.randn(q.shape, generator=gen, device=DEVICE).to(q.dtype))
        lens.copy_(torch.randint(0, nb * bs, (t,), generator=gen, device=DEVICE))
        graph.replay()
        want = tk.index_topk(q, w, cache, tables, lens, topk, max_len=nb * bs)
        assert torch.equal(out, want)


# ---------------------------------------------------------------- GPU targets

AOT_SCRIPT = r"""
import json, sys
from aot import cubin_usage
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_mla.ops.sparse_indexer import triton_kernels as k

ALIGNED = {"block_size", "s_kt", "s_page", "s_qt", "s_qh", "s_wt", "s_bt", "s_ot"}
report = []
for arch, kernel, q_fp8, block_h in json.loads(sys.argv[1]):
    if kernel == "insert":
        fn, warps, stages = k._insert_keys_kernel, k.NUM_WARPS, 3
        sig = {"k_ptr": "*bf16", "slot_ptr": "*i64", "cache_ptr": "*u8"}
        sig.update({n: "i32" for n in ("T", "num_rows", "block_size", "s_kt", "s_kd", "s_page")})
        const = dict(UE8M0=True, BLOCK_T=k.INSERT_BLOCK_T)
    else:
        fn, warps, stages = k._paged_logits_kernel, k.NUM_WARPS, 1
        sig = {"q_ptr": "*u8" if q_fp8 else "*bf16", "w_ptr": "*fp32", "cache_ptr": "*u8",
               "bt_ptr": "*i32", "len_ptr": "*i32", "out_ptr": "*fp32"}
        sig.update({n: "i32" for n in ("H", "S", "bt_width", "num_blocks", "block_size", "s_qt",
                                       "s_qh", "s_wt", "s_bt", "s_page", "s_ot")})
        const = dict(Q_FP8=q_fp8, BLOCK_H=block_h, BLOCK_N=k.BLOCK_N, INTERPRET=False)
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n.endswith("_ptr") or n in ALIGNED}
    sig.update({c: "constexpr" for c in const})
    ck = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", arch, 32),
                        options=dict(num_warps=warps, num_stages=stages))
    usage = cubin_usage(ck)
    report.append({"arch": arch, "kernel": kernel, "q_fp8": q_fp8, "block_h": block_h,
                   "shared": ck.metadata.shared, "usage": usage})
print(json.dumps(report))
"""


def test_kernels_compile_for_gpu_targets():
    """Lower both kernels to cubin for sm80/89/90/120 with Triton's bundled ptxas (no GPU
    needed): logits at both head tiles the launcher uses (16, 32), e4m3 and bf16 queries.
    They compile, fit the 99 KiB shared-memory limit (SM89, SM12x) and do not spill."""
    assert {triton_kernels._block_h(h) for h in (1, 16, 17, 32, 64, 128)} == {16, 32}

    pytest.importorskip("triton.backends.nvidia")
    cases = []
    for arch in (80, 89, 90, 120):
        cases += [[arch, "insert", False, 0]]
        cases += [[arch, "logits", fp8, bh] for fp8 in (True, False) for bh in (16, 32)]
    report = compile_report(AOT_SCRIPT, cases)
    assert_fits(report)
