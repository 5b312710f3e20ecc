"""The plain-torch DSA lightning indexer: quantization, index-key cache, logits, top-k."""

from __future__ import annotations

import pytest
import torch

from vllm_mla.ops import sparse_indexer as ix
from vllm_mla.ops.sparse_indexer import IndexerError


def test_rows_quantize_with_power_of_two_scales_that_fit():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 128, generator=gen) * torch.logspace(-3, 2, 7)[:, None, None]
    values, scales = ix.quantize_rows(x, ue8m0=True)
    assert scales.shape == (7, 3) and values.dtype == torch.float8_e4m3fn
    assert bool((scales.view(torch.int32) & 0x807FFFFF == 0).all())  # positive powers of two
    amax = x.abs().amax(-1)
    assert bool((amax / scales <= 448).all()) and bool((amax / scales > 224).all())
    _, plain = ix.quantize_rows(x, ue8m0=False)
    assert torch.equal(plain, amax / 448)  # the same exact fp32 max, one rounded division
    tiny = ix.quantize_rows(torch.zeros(2, 128))[1]  # the floor keeps zeros finite
    assert torch.equal(tiny, torch.full((2,), 2.0**-22))  # 1e-4 / 448 -> next power of two
    # 1e-10 / 448 -> 2**-42 (2.3e-13); the default floor would give 2**-22
    assert ix.quantize_rows(torch.zeros(1, 128), floor=1e-10)[1].item() < 1e-12


def test_the_cache_holds_values_then_scales_per_page():
    cache = torch.zeros(3, 4, ix.RECORD_BYTES, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(3, 128, generator=gen)
    slots = torch.tensor([5, -1, 11])  # page 1 slot 1, skipped, page 2 slot 3
    ix.insert_keys(cache, k, slots)
    values, scales = ix.quantize_rows(k)
    page = cache[1].reshape(-1)  # 4 * 132 bytes: 4 x 128 value bytes, then 4 fp32 scales
    assert torch.equal(page[128:256], values[0].view(torch.uint8))
    assert page[512 + 4 : 512 + 8].view(torch.float32).item() == scales[0].item()
    assert int(cache[0].sum()) == 0  # the skipped row wrote nothing
    got_v, got_s = ix.read_keys(cache, torch.tensor([5, 11]))
    assert torch.equal(got_v.view(torch.uint8), values[[0, 2]].view(torch.uint8))
    assert torch.equal(got_s, scales[[0, 2]])


def test_the_cache_layout_is_checked_by_name():
    with pytest.raises(IndexerError, match="index-key cache: expected uint8"):
        ix.insert_keys(
            torch.zeros(1, 4, 128, dtype=torch.uint8),
            torch.zeros(1, 128),
            torch.zeros(1, dtype=torch.long),
        )
    with pytest.raises(IndexerError, match=r"k: expected \[T=2, 128\]"):
        ix.insert_keys(
            torch.zeros(1, 4, 132, dtype=torch.uint8),
            torch.zeros(1, 128),
            torch.zeros(2, dtype=torch.long),
        )


def test_logits_are_relu_dots_weighted_over_heads_times_the_key_scale():
    gen = torch.Generator().manual_seed(2)
    q, w = torch.randn(2, 5, 128, generator=gen), torch.rand(2, 5, generator=gen)
    k, ks = torch.randn(9, 128, generator=gen), torch.rand(9, generator=gen)
    got = ix.logits(q, w, k, ks)
    want = torch.zeros(2, 9)
    for t in range(2):
        for j in range(9):
            want[t, j] = ks[j] * sum(w[t, h] * torch.relu(q[t, h] @ k[j]) for h in range(5))
    # fp32 both sides in other orders: 128-term dots, 5-term head sums, 2 products each
    # (relu is 1-Lipschitz): <= 2 * (128 + 5 + 2) * 2**-24 of ks * sum_h |w| |q| . |k|
    terms = ks * torch.einsum("th,thd,sd->ts", w.abs(), q.abs(), k.abs())
    assert ((got - want).abs() <= 2 * (128 + 5 + 2) * 2.0**-24 * terms).all()


def test_top_k_breaks_ties_toward_the_lower_position_and_pads():
    scores = torch.tensor([[0.0, 2.0, 2.0, 0.0, 5.0, 0.0], [1.0, 3.0, 9.0, 9.0, 9.0, 9.0]])
    got = ix.select_topk(scores, torch.tensor([6, 3]), topk=4)
    assert got.tolist() == [[4, 1, 2, 0], [2, 1, 0, -1]]  # row 1: only 3 causal positions
    assert ix.select_topk(scores, torch.tensor([2, 0]), topk=3).tolist() == [
        [1, 0, -1],
        [-1, -1, -1],
    ]
    wide = ix.select_topk(scores, torch.tensor([6, 6]), topk=10)  # K larger than the context
    assert wide.shape == (2, 10) and wide[0, 6:].tolist() == [-1] * 4


@pytest.mark.parametrize("topk", [1, 4, 16, 64])
def test_index_topk_equals_a_direct_computation_across_pages(topk):
    gen = torch.Generator().manual_seed(topk)
    block, pages = 4, 6
    cache = torch.zeros(pages, block, ix.RECORD_BYTES, dtype=torch.uint8)
    keys = torch.randn(pages * block, 128, generator=gen)
    ix.insert_keys(cache, keys, torch.arange(pages * block))
    tables = torch.tensor([[5, 0, 3], [2, 4, 1]], dtype=torch.int32)  # interleaved pages
    q = torch.randn(3, 32, 128, generator=gen)
    w = torch.rand(3, 32, generator=gen)
    req, lengths = torch.tensor([0, 1, 1]), torch.tensor([9, 3, 12])
    got = ix.index_topk(q, w, cache, tables[req], lengths, topk)
    values, scales = ix.read_keys(cache, torch.arange(pages * block))
    for t in range(3):
        rows = ix.request_rows(tables[req[t]], int(lengths[t]), block)
        s = ix.logits(q[t : t + 1], w[t : t + 1], values[rows], scales[rows])[0]
        order = sorted(range(len(s)), key=lambda j: (-float(s[j]), j))[:topk]
        want = order + [-1] * (topk - len(order))
        assert got[t].tolist() == want


def _insert_args():
    return torch.zeros(2, 4, ix.RECORD_BYTES, dtype=torch.uint8), torch.zeros(3, 128)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"slots": torch.tensor([0, 8, 1])}, r"slots: expected < num_blocks \* block_size = 8"),
        ({"slots": torch.tensor([[0], [1], [2]])}, "slots: expected a 1-D integer tensor"),
        ({"slots": torch.tensor([0.0, 1.0, 2.0])}, "slots: expected a 1-D integer tensor"),
        ({"cache": [[0]]}, "index-key cache: expected uint8"),
        ({"k": torch.zeros(3, 128, device="meta")}, "k: expected a float tensor on cpu"),
        ({"k": torch.zeros(3, 128, dtype=torch.int32)}, "k: expected a float tensor"),
        (
            {"cache": torch.zeros(8 * 132 + 1, dtype=torch.uint8)[1:].view(2, 4, 132)},
            "index-key cache: expected a storage offset and page stride that are multiples of 4",
        ),
    ],
)
def test_insert_keys_refuses_bad_input_by_name(change, match):
    cache, k = _insert_args()
    args = {"cache": cache, "k": k, "slots": torch.arange(3), **change}
    with pytest.raises(IndexerError, match=match):
        ix.insert_keys(args["cache"], args["k"], args["slots"])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"block_tables": torch.zeros(1, 2, dtype=torch.int32)}, r"block_tables: expected \[T=2"),
        ({"block_tables": torch.zeros(2, dtype=torch.int32)}, "block_tables: expected a 2-D"),
        ({"block_tables": torch.full((2, 2), 2, dtype=torch.int32)}, r"pages in \[0, 2\)"),
        ({"block_tables": torch.full((2, 2), -1, dtype=torch.int32)}, r"pages in \[0, 2\)"),
        ({"lengths": torch.tensor([1, 9], dtype=torch.int32)}, r"lengths: expected <= .* = 8"),
        ({"lengths": torch.ones(2)}, "lengths: expected a 1-D integer tensor"),
        ({"topk": -1}, "topk: expected an int >= 0"),
        ({"cache": torch.zeros(2 * 4 * 132, dtype=torch.uint8)}, "index-key cache: expected"),
    ],
)
def test_index_topk_refuses_bad_input_by_name(change, match):
    with pytest.raises(IndexerError, match=match):
        ix.index_topk(**{**_topk_args(), **change})


def _topk_args():
    return {
        "q": torch.randn(2, 3, 128),
        "weights": torch.rand(2, 3),
        "cache": torch.zeros(2, 4, ix.RECORD_BYTES, dtype=torch.uint8),
        "block_tables": torch.tensor([[1, 0], [0, 1]], dtype=torch.int32),
        "lengths": torch.tensor([3, 8], dtype=torch.int32),
        "topk": 2,
    }


def test_index_topk_checks_only_the_pages_a_token_reads():
    # block-table entries past a token's length are padding and may hold anything
    tables = torch.tensor([[1, 99], [0, 1]], dtype=torch.int32)
    assert ix.index_topk(**{**_topk_args(), "block_tables": tables}).shape == (2, 2)
