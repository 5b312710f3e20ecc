"""The kpool indexer (GLM-5.3-Flash) reference against independent formulations, its
Triton compression (interpreted on CPU) and the public calls' argument checks."""

from __future__ import annotations

import pytest
import torch

from vllm_mla.formats import INDEX_HEAD_DIM, INDEX_RECORD_BYTES
from vllm_mla.ops.kpool_indexer import reference as ref
from vllm_mla.ops.kpool_indexer.reference import IndexerError
from vllm_mla.ops.sparse_indexer import reference as dsa

D = INDEX_HEAD_DIM


def rand(*shape, seed, scale=1.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def sylvester() -> torch.Tensor:
    i = torch.arange(D)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    parity = torch.zeros_like(bits)
    for b in range(7):
        parity ^= (bits >> b) & 1
    return (1 - 2 * parity).double() / D**0.5


def test_hadamard_is_the_normalized_sylvester_matrix():
    x = rand(5, 3, D, seed=0, scale=10)
    got = ref.hadamard128(x).double()
    want = x.double() @ sylvester()
    # 7 butterfly stages and one scale, each rounding by <= 2**-24 relative of a partial
    # sum bounded by sum|x|: <= 8 * 2**-24 * sum|x| ~ 5e-7 of it; 1e-6 leaves 2x.
    bound = 1e-6 * x.abs().sum(-1, keepdim=True).double()
    assert ((got - want).abs() <= bound).all()
    assert torch.allclose(ref.hadamard128(ref.hadamard128(x)), x, atol=1e-4)  # H H = I


def test_compress_pools_matches_the_softmax_formulation():
    p, kpool = 7, 4
    k = rand(p, kpool, D, seed=1, scale=3, dtype=torch.bfloat16)
    gate = rand(p, kpool, D, seed=2, scale=4, dtype=torch.bfloat16)
    ape = rand(kpool, D, seed=3)
    probs = torch.softmax(gate.double() + ape.double(), dim=1)
    mean = (probs * k.double()).sum(1)
    got = ref.compress_pools(k, gate, ape).double()
    want = mean.to(torch.bfloat16).double() @ sylvester()
    # The mean differs from float64 by fp32 rounding (~1e-6 relative) which can flip its
    # bf16 rounding by one ulp (2**-8 relative of the element, |mean| <= max|k|); through
    # H that moves an output by <= 2**-8 * max|mean| * sqrt(128) / sqrt(128) per flipped
    # element summed: <= 2**-8 * sum|mean| / sqrt(128); plus the output's own bf16
    # rounding (2**-8 relative): bound both.
    bound = 2.0**-8 * (mean.abs().sum(-1, keepdim=True) / D**0.5 + want.abs()) + 1e-6
    assert ((got - want).abs() <= bound).all()


def test_no_complete_pool_compresses_to_nothing():
    """A request shorter than one pool (a new prompt of a few tokens) has no pool: zero
    rows in, zero rows out, the reference and the op alike."""
    from vllm_mla.ops.kpool_indexer import api

    empty = torch.zeros(0, 4, D, dtype=torch.bfloat16)
    ape = rand(4, D, seed=3)
    for compress in (ref.compress_pools, api.compress_pools):
        assert compress(empty, empty, ape).shape == (0, D)
    few = torch.zeros(3, D, dtype=torch.bfloat16)
    assert ref.request_pools(few, few, ape).shape == (0, D)


def test_expansion_matches_a_loop():
    kpool = 4
    pool_ids = torch.tensor([[3, 0], [1, -1], [-1, -1], [5, 2]])
    seq_lens = torch.tensor([17, 7, 2, 24])
    got = ref.expand_pools_and_tail(pool_ids, seq_lens, kpool)
    assert got.shape == (4, 128) and got.dtype == torch.int32
    for row in range(4):
        want = []
        for g in pool_ids[row].tolist():
            want += [g * kpool + o if g >= 0 else -1 for o in range(kpool)]
        length = int(seq_lens[row])
        tail = list(range(length - length % kpool, length))
        want += tail + [-1] * (kpool - 1 - len(tail))
        want += [-1] * (128 - len(want))
        assert got[row].tolist() == want, row


@pytest.mark.parametrize(("topk", "kpool", "width"), [(2048, 16, 2176), (16, 4, 128), (8, 1, 128)])
def test_output_width(topk, kpool, width):
    assert ref.output_width(topk, kpool) == width


def test_kpool_one_has_no_tail():
    got = ref.expand_pools_and_tail(torch.tensor([[4, 1]]), torch.tensor([9]), 1, 2)
    assert got.tolist() == [[4, 1]]


def test_compressed_slot_mapping_matches_a_loop():
    bs, kpool = 4, 4
    table = torch.tensor([7, 2, 5])
    positions = torch.arange(40)
    got = ref.compressed_slot_mapping(positions, table.expand(40, 3), bs, kpool)
    for p in range(40):
        want = -1
        if (p + 1) % kpool == 0:
            pool = p // kpool
            want = int(table[pool // bs]) * bs + pool % bs
        assert int(got[p]) == want, p


def pool_cache(num_blocks, block_size):
    return torch.zeros(num_blocks, block_size, INDEX_RECORD_BYTES, dtype=torch.uint8)


def test_decode_ring_builds_the_pools_prefill_builds():
    """Prefill pooling of a request and decode (one token at a time through the tail ring)
    write the same bytes: the ring holds exactly the pool's earlier tokens."""
    kpool, ring, length, bs = 4, 8, 30, 4
    k = rand(length, D, seed=4, dtype=torch.bfloat16)
    gate = rand(length, D, seed=5, scale=3, dtype=torch.bfloat16)
    ape = rand(kpool, D, seed=6)
    table = torch.tensor([[3, 0]])
    positions = torch.arange(length)
    slots = ref.compressed_slot_mapping(positions, table.expand(length, 2), bs, kpool)
    prefill = pool_cache(4, bs)
    ref.insert_pools(prefill, ref.request_pools(k, gate, ape), slots[slots >= 0])
    decode = pool_cache(4, bs)
    tail = torch.zeros(3, 2, ring, D, dtype=torch.bfloat16)
    tail_block = 2
    tail_slots = tail_block * ring + positions % ring
    for p in range(length):  # one decode step per token
        s = slice(p, p + 1)
        ref.decode_step(decode, tail, k[s], gate[s], ape, positions[s], slots[s], tail_slots[s])
    assert torch.equal(prefill, decode)
    # the ring's last entries are the request's tail, K then gate
    for p in range(length - length % kpool, length):
        assert torch.equal(tail[tail_block, 0, p % ring], k[p])
        assert torch.equal(tail[tail_block, 1, p % ring], gate[p])


def build_request(length, heads, kpool, *, seed, bs=4):
    """(q e4m3, folded weights, pool cache, block table row) of one request."""
    q, scale = ref.quantize_query(rand(length, heads, D, seed=seed, dtype=torch.bfloat16))
    w = ref.fold_weights(rand(length, heads, seed=seed + 1), scale)
    k = rand(length, D, seed=seed + 2, dtype=torch.bfloat16)
    gate = rand(length, D, seed=seed + 3, dtype=torch.bfloat16)
    ape = rand(kpool, D, seed=seed + 4)
    pools = length // kpool
    pages = -(-pools // bs)
    table = torch.randperm(pages + 2, generator=torch.Generator().manual_seed(seed))[:pages]
    cache = pool_cache(pages + 2, bs)
    rows = dsa.request_rows(table, pools, bs)
    ref.insert_pools(cache, ref.request_pools(k, gate, ape), rows)
    return q, w, cache, table, (k, gate, ape)


def independent_selection(q, w, cache, table, length, topk, kpool, bs=4):
    """Per token: float64 scores of the dequantized pools, sorted in Python (ties toward
    the lower pool), the tokens of the best pools and then the tail, as a list."""
    pools = length // kpool
    values, scales = dsa.read_keys(cache, dsa.request_rows(table, pools, bs))
    keys = values.double() * scales.double()[:, None]
    out = []
    for t in range(length):
        visible = (t + 1) // kpool
        scores = [
            sum(
                float(w[t, h]) * max(0.0, float(q[t, h].double() @ keys[g]))
                for h in range(q.shape[1])
            )
            for g in range(visible)
        ]
        best = sorted(range(visible), key=lambda g: (-scores[g], g))[: topk // kpool]
        tokens = [g * kpool + o for g in best for o in range(kpool)]
        tail_start = (t + 1) - (t + 1) % kpool
        out.append((tokens, list(range(tail_start, t + 1)), scores, best))
    return out


@pytest.mark.parametrize(("length", "topk", "kpool"), [(37, 16, 4), (21, 4, 2)])
def test_index_topk_matches_an_independent_selection(length, topk, kpool):
    heads = 3
    q, w, cache, table, _ = build_request(length, heads, kpool, seed=10 + kpool)
    tables = table.expand(length, table.shape[0])
    seq_lens = torch.arange(1, length + 1)
    got = ref.index_topk(q, w, cache, tables, seq_lens, topk, kpool)
    assert got.shape == (length, ref.output_width(topk, kpool))
    want = independent_selection(q, w, cache, table, length, topk, kpool)
    near_ties = 0
    for t, (tokens, tail, scores, best) in enumerate(want):
        hist = got[t, :topk].tolist()
        assert hist[len(tokens) :] == [-1] * (topk - len(tokens))
        tail_cols = got[t, topk : topk + kpool - 1].tolist()
        assert tail_cols == tail + [-1] * (kpool - 1 - len(tail))
        assert (got[t, topk + kpool - 1 :] == -1).all()
        if sorted(hist[: len(tokens)]) != sorted(tokens):
            # fp32 sums (reference) vs float64 here: <= ~(128 + heads) * 2**-24 of the
            # score magnitude apart; a differing pool must be that close to the boundary.
            chosen = {x // kpool for x in hist if x >= 0}
            boundary = scores[best[-1]]
            for g in chosen ^ set(best):
                assert abs(scores[g] - boundary) <= 1e-5 * max(map(abs, scores)), (t, g)
                near_ties += 1
    assert near_ties == 0  # random data: none expected


def test_short_contexts_select_every_token():
    """L <= topk: every pool is selected, so the set is vLLM's causal fill ``0 .. L-1``."""
    length, topk, kpool = 16, 16, 4
    q, w, cache, table, _ = build_request(length, 2, kpool, seed=30)
    got = ref.index_topk(q, w, cache, table.expand(length, -1), torch.arange(1, 17), topk, kpool)
    for t in range(length):
        assert sorted(x for x in got[t].tolist() if x >= 0) == list(range(t + 1))


def test_dense_topk_is_the_paged_selection():
    length, topk, kpool, heads = 29, 8, 4, 2
    q_raw = rand(length, heads, D, seed=40, dtype=torch.bfloat16)
    w_raw = rand(length, heads, seed=41)
    k = rand(length, D, seed=42, dtype=torch.bfloat16)
    gate = rand(length, D, seed=43, dtype=torch.bfloat16)
    ape = rand(kpool, D, seed=44)
    dense = ref.dense_topk(q_raw, w_raw, k, gate, ape, topk)
    q, scale = ref.quantize_query(q_raw)
    cache = pool_cache(2, 4)
    ref.insert_pools(cache, ref.request_pools(k, gate, ape), torch.arange(length // kpool))
    tables = torch.tensor([[0, 1]]).expand(length, 2)
    paged = ref.index_topk(
        q, ref.fold_weights(w_raw, scale), cache, tables, torch.arange(1, length + 1), topk, kpool
    )
    assert torch.equal(dense, paged)


# -- argument checks: each rule once -----------------------------------------------------
def _pool_args(p=2, kpool=4):
    k = torch.zeros(p, kpool, D, dtype=torch.bfloat16)
    return k, k.clone(), torch.zeros(kpool, D)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: ref.output_width(10, 4), "topk"),
        (lambda: ref.output_width(8, 0), "kpool"),
        (lambda: ref.compress_pools(*_pool_args()[:2], torch.zeros(4, D).double()), "ape"),
        (lambda: ref.compress_pools(*_pool_args()[:2], torch.zeros(3, D)), "ape"),
        (lambda: ref.compress_pools(_pool_args()[0], _pool_args(3)[1], _pool_args()[2]), "gate"),
        (
            lambda: ref.compress_pools(
                torch.zeros(2, 4, 64), torch.zeros(2, 4, 64), torch.zeros(4, 64)
            ),
            "k",
        ),
        (
            lambda: ref.expand_pools_and_tail(
                torch.zeros(2, 2), torch.zeros(2, dtype=torch.long), 4
            ),
            "pool_ids",
        ),
        (
            lambda: ref.expand_pools_and_tail(
                torch.zeros(2, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long), 4
            ),
            "seq_lens",
        ),
        (
            lambda: ref.expand_pools_and_tail(
                torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 4, 10
            ),
            "width",
        ),
        (lambda: ref.fold_weights(torch.zeros(3, 2), torch.zeros(3, 4)), "q_scale"),
        (
            lambda: ref.decode_step(
                pool_cache(1, 4),
                torch.zeros(1, 2, 6, D, dtype=torch.bfloat16),
                *_pool_args(1)[:2],
                torch.zeros(4, D),
                torch.tensor([0]),
                torch.tensor([-1]),
                torch.tensor([0]),
            ),
            "tail_cache",
        ),
    ],
)
def test_argument_rules(call, name):
    with pytest.raises(IndexerError, match=f"^{name}: expected"):
        call()


# -- Triton (interpreted on CPU; on the GPU in benchmarks/gpu_check.sh indexer) -----------
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_compression_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical in the interpreter (the same fp32 operations, numpy's exp on both
    sides); on a GPU only exp differs, within ``COMPRESS_RTOL`` of the row's largest value
    (its error model is in ``triton_kernels``)."""
    if DEVICE == "cpu":
        assert torch.equal(got, want)
        return
    from vllm_mla.ops.kpool_indexer.triton_kernels import COMPRESS_RTOL

    scale = want.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= COMPRESS_RTOL * scale).all()


GPU_ONLY = pytest.mark.skipif(DEVICE == "cpu", reason="minutes in the interpreter: GPU only")


# kpool 16 is GLM-5.3-Flash's; 4096 pools a 64k-token prefill's
@pytest.mark.parametrize(
    ("pools", "kpool"), [(9, 4), (64, 16), pytest.param(4096, 16, marks=GPU_ONLY)]
)
def test_triton_compression_equals_the_reference(pools, kpool):
    pytest.importorskip("triton")
    from vllm_mla.ops.kpool_indexer import api

    k = rand(pools, kpool, D, seed=50, scale=3, dtype=torch.bfloat16).to(DEVICE)
    gate = rand(pools, kpool, D, seed=51, scale=4, dtype=torch.bfloat16).to(DEVICE)
    ape = rand(kpool, D, seed=52).to(DEVICE)
    got = api.compress_pools(k, gate, ape, impl="triton")
    assert_compression_matches(got, ref.compress_pools(k, gate, ape))
    # strided inputs: a pool view of a request's tokens
    tokens = rand(pools * kpool + 3, D, seed=53, dtype=torch.bfloat16).to(DEVICE)
    view = tokens[3:].view(pools, kpool, D)
    assert_compression_matches(
        api.compress_pools(view, gate, ape, impl="triton"), ref.compress_pools(view, gate, ape)
    )


def test_triton_compression_checks_its_arguments():
    pytest.importorskip("triton")
    from vllm_mla.ops.kpool_indexer import api

    k, gate, ape = _pool_args()
    with pytest.raises(IndexerError, match=r"^out: expected"):
        api.compress_pools(k, gate, ape, out=torch.empty(2, D), impl="triton")
    with pytest.raises(IndexerError, match=r"^gate: expected"):
        api.compress_pools(k, gate.transpose(0, 1), ape, impl="triton")


def test_triton_index_topk_equals_the_reference():
    pytest.importorskip("triton")
    from vllm_mla.ops.kpool_indexer import api

    length, topk, kpool = 37, 16, 4
    q, w, cache, table, _ = build_request(length, 3, kpool, seed=60)
    tables = table.expand(length, -1).to(torch.int32)
    seq_lens = torch.arange(1, length + 1, dtype=torch.int32)
    want = ref.index_topk(q, w, cache, tables, seq_lens, topk, kpool)
    q, w, cache, tables, seq_lens = (t.to(DEVICE) for t in (q, w, cache, tables, seq_lens))
    got = api.index_topk(
        q, w, cache, tables, seq_lens, topk, kpool, max_pools=length // kpool, impl="triton"
    ).cpu()
    # Same logits up to fp32 summation order (sparse_indexer LOGIT_RTOL); random data
    # leaves no pool pair that close, so the selections are identical.
    assert torch.equal(got, want)
