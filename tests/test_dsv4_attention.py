"""DeepSeek-V4's sparse attention with the sink (``vllm_mla.ops.dsv4.attention``)."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_mla.formats import DSV4_RECORD
from vllm_mla.ops.dsv4 import attention, record

B = 8


def setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, B * DSV4_RECORD, dtype=torch.uint8)
    record.write(cache, torch.randn(2 * B, 512, generator=gen), torch.arange(2 * B), B)
    q = torch.randn(2, 3, 512, generator=gen) * 0.2
    return cache, q


def test_one_softmax_over_both_sources_and_the_sink():
    """Token 0 of head h written out: scores of its window and compressed rows, the sink
    logit in the denominator only, the values the same rows."""
    cache, q = setup()
    window = torch.tensor([[3, 4, -1], [0, -1, -1]])
    compressed = torch.tensor([[9, 12], [-1, -1]])
    sink = torch.tensor([0.5, -1.0, float("-inf")])
    out = attention.attend(q, cache, window, B, cache, compressed, B, sink, 0.05)
    rows = record.read(cache, torch.tensor([3, 4, 9, 12]), B)
    for h in range(3):
        s = 0.05 * rows @ q[0, h]
        e = torch.exp(s - s.max())
        denominator = e.sum() + math.exp(sink[h].item() - s.max().item())
        assert torch.allclose(out[0, h], (e / denominator) @ rows, rtol=1e-5, atol=1e-6)
    # token 1: one row; with no sink (head 2) it is that row, with a sink less of it
    only = record.read(cache, torch.tensor([0]), B)[0]
    assert torch.allclose(out[1, 2], only)
    assert out[1, 0].norm() < only.norm()


def test_no_token_and_no_sink_gives_zeros_and_a_bad_query_names_its_shape():
    cache, q = setup()
    none = torch.full((2, 2), -1)
    out = attention.attend(q, cache, none, B, None, None, B, torch.full((3,), -math.inf), 1.0)
    assert out.eq(0).all() and not out.isnan().any()
    with pytest.raises(ValueError, match=r"queries must be \[T, H, 512\], got \(2, 576\)"):
        attention.attend(torch.zeros(2, 576), cache, none, B, None, None, B, torch.zeros(3), 1.0)


def test_long_prefills_run_in_chunks_of_tokens(monkeypatch):
    """Past ``MAX_GATHERED`` the queries run in chunks of tokens: the same outputs, and
    no chunk gathers more (a 4,350-token prefill gathered 4.8 GB at once before)."""
    cache, _ = setup()
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(7, 3, 512, generator=gen) * 0.2
    window = torch.randint(-1, 16, (7, 3), generator=gen)
    compressed = torch.randint(-1, 16, (7, 2), generator=gen)
    sink = torch.tensor([0.5, -1.0, float("-inf")])
    whole = attention.attend(q, cache, window, B, cache, compressed, B, sink, 0.05)
    gathered = []
    read = record.read
    monkeypatch.setattr(record, "read", lambda c, s, b: gathered.append(s.numel()) or read(c, s, b))
    monkeypatch.setattr(attention, "MAX_GATHERED", 2 * 5 * 512)  # two tokens of 5 rows
    chunked = attention.attend(q, cache, window, B, cache, compressed, B, sink, 0.05)
    assert torch.equal(chunked, whole)
    assert max(gathered) == 2 * 3 and len(gathered) == 2 * 4  # 4 chunks, two sources each
