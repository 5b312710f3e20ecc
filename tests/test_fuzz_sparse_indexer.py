"""Fuzz properties of the DSA indexer oracle (vllm_mla.ops.sparse_indexer).

The harness, budgets and rules: tests/fuzz.py.
"""

from __future__ import annotations

import torch
from fuzz import (
    BF16,
    F32,
    FUZZ,
    Placed,
    assert_refused,
    devices,
    layout,
    randn,
    seeds,
)
from hypothesis import given
from hypothesis import strategies as st

from vllm_mla.ops import sparse_indexer as ix
from vllm_mla.ops.sparse_indexer import IndexerError


def index_cache(draw, device, nb: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed ``[nb, bs, 132]`` cache whose pages interleave with other layers' (dim-0
    stride a multiple of the page); returns (cache, the whole buffer)."""
    layers = draw(st.integers(1, 2))
    buf = torch.zeros(nb, layers, bs, ix.RECORD_BYTES, dtype=torch.uint8, device=device)
    return buf[:, draw(st.integers(0, layers - 1))], buf


@given(data=st.data())
@FUZZ
def test_indexer_insert_keys_writes_exactly_the_named_slots(data):
    """Keys (any float dtype, strided, some slots negative) land at their physical slots
    as quantize_rows of the row (values and scale bit-exact, read back by read_keys);
    every other byte of the cache buffer stays zero."""
    device = data.draw(devices)
    nb, bs = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    cache, buf = index_cache(data.draw, device, nb, bs)
    rows = nb * bs
    chosen = data.draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows))
    slots = chosen + data.draw(st.lists(st.integers(-5, -1), max_size=3))
    slots = data.draw(st.permutations(slots))
    dtype = data.draw(st.sampled_from((F32, BF16, torch.float16)))
    scale = 10.0 ** data.draw(st.integers(-6, 3))
    k = randn(data.draw(seeds), (len(slots), 128), dtype, device, scale)
    k = Placed(k, layout(data.draw, 2, last=False))
    ue8m0 = data.draw(st.booleans())
    ix.insert_keys(cache, k.view, torch.tensor(slots, dtype=torch.long, device=device), ue8m0=ue8m0)
    k.assert_unchanged()
    keep = [i for i, s in enumerate(slots) if s >= 0]
    if keep:
        values, scales = ix.quantize_rows(k.view[keep].contiguous(), ue8m0=ue8m0)
        got_v, got_s = ix.read_keys(cache, torch.tensor([slots[i] for i in keep], device=device))
        assert torch.equal(got_v.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(got_s, scales)
    rest = torch.tensor(sorted(set(range(rows)) - set(chosen)), dtype=torch.long, device=device)
    got_v, got_s = ix.read_keys(cache, rest)
    assert not got_v.view(torch.uint8).any() and not got_s.any()
    written = int(buf.count_nonzero())
    assert written <= len(keep) * ix.RECORD_BYTES


@given(data=st.data())
@FUZZ
def test_indexer_index_topk_selects_the_top_logits(data):
    """Any T (0 included), heads, block tables over interleaved pages, lengths from -1 to the
    table's capacity and K from 0 past the context: the K largest logits of each token's
    causal positions, ties to the lower position, descending, -1 padded
    (the direct computation of test_sparse_indexer)."""
    device = data.draw(devices)
    nb, bs = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    cache, _ = index_cache(data.draw, device, nb, bs)
    seed = data.draw(seeds)
    keys = randn(seed, (nb * bs, 128), device=device)
    ix.insert_keys(cache, keys, torch.arange(nb * bs, device=device))
    t, h, width = (
        data.draw(st.integers(0, 3)),
        data.draw(st.integers(1, 4)),
        data.draw(st.integers(1, 3)),
    )
    pages = st.lists(st.integers(0, nb - 1), min_size=width, max_size=width)
    tables = torch.tensor(data.draw(st.lists(pages, min_size=t, max_size=t)), dtype=torch.int32)
    tables = tables.view(t, width).to(device)
    lengths = data.draw(st.lists(st.integers(-1, width * bs), min_size=t, max_size=t))
    lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
    topk = data.draw(st.integers(0, width * bs + 2))
    q = Placed(randn(seed + 1, (t, h, 128), device=device), layout(data.draw, 3, last=False))
    w = randn(seed + 2, (t, h), device=device)
    got = ix.index_topk(q.view, w, cache, tables, lengths, topk)
    assert got.shape == (t, topk) and got.dtype == torch.int32
    for i in range(t):
        n = max(0, int(lengths[i]))
        want = []
        if n:
            keys, key_scales = ix.read_keys(cache, ix.request_rows(tables[i], n, bs))
            s = ix.logits(q.view[i : i + 1], w[i : i + 1], keys, key_scales)[0].tolist()
            want = sorted(range(n), key=lambda j: (-s[j], j))[:topk]
        assert got[i].tolist() == want + [-1] * (topk - len(want))


INDEXER_BAD = (
    "cache dtype",
    "cache width",
    "cache rank",
    "cache pages strided",
    "k width",
    "k rows",
    "q rank",
    "q width",
    "weights shape",
    "lengths shape",
    "topk cache",
)


@given(kind=st.sampled_from(INDEXER_BAD), device=devices, t=st.integers(1, 3))
@FUZZ
def test_indexer_refuses_bad_input_by_name(kind, device, t):
    """A wrong cache layout, key / query / weights / lengths shape: IndexerError naming it."""
    cache = torch.zeros(2, 4, ix.RECORD_BYTES, dtype=torch.uint8, device=device)
    k, slots = torch.zeros(t, 128, device=device), torch.arange(t, device=device)
    q, w = torch.zeros(t, 2, 128, device=device), torch.zeros(t, 2, device=device)
    tables = torch.zeros(t, 2, dtype=torch.int32, device=device)
    lengths = torch.ones(t, dtype=torch.int32, device=device)
    wide = torch.zeros(2, 4, 2 * ix.RECORD_BYTES, dtype=torch.uint8, device=device)

    def insert(c=cache, k=k):
        return lambda: ix.insert_keys(c, k, slots)

    def topk(q=q, w=w, c=cache, lengths=lengths):
        return lambda: ix.index_topk(q, w, c, tables, lengths, 2)

    cases = {
        "cache dtype": (insert(c=cache.float()), "index-key cache"),
        "cache width": (insert(c=cache[..., :128]), "index-key cache"),
        "cache rank": (insert(c=cache[0]), "index-key cache"),
        "cache pages strided": (insert(c=wide[..., : ix.RECORD_BYTES]), "index-key cache"),
        "k width": (insert(k=k[:, :64]), "k: expected"),
        "k rows": (insert(k=torch.zeros(t + 1, 128, device=device)), "k: expected"),
        "q rank": (topk(q=q[:, 0]), "q: expected"),
        "q width": (topk(q=q[..., :64]), "q: expected"),
        "weights shape": (topk(w=w[:, :1]), "weights: expected"),
        "lengths shape": (topk(lengths=lengths[:0]), "lengths: expected"),
        "topk cache": (topk(c=cache.float()), "index-key cache"),
    }
    call, named = cases[kind]
    assert_refused(call, IndexerError, named)
