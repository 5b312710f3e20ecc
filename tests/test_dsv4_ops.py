"""DeepSeek-V4's torch ops (``vllm_mla.ops.dsv4``): RoPE, routing, compressors, indexer
queries, each against its definition written out."""

from __future__ import annotations

import math

import torch

from vllm_mla.formats import DSV4_RECORD
from vllm_mla.ops.dsv4 import compressor, indexer, record, rope, routing

gen = torch.Generator().manual_seed(0)


def table(n: int = 64) -> torch.Tensor:
    angles = torch.arange(n)[:, None] * 10000.0 ** (-torch.arange(32) / 32)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def test_rope_turns_the_last_64_values_in_pairs_and_back():
    x = torch.randn(3, 2, 512, generator=gen)
    pos = torch.tensor([0, 5, 63])
    turned = rope.rotate(x, pos, table())
    assert torch.equal(turned[0], x[0]) and torch.equal(turned[:, :, :448], x[:, :, :448])
    cos, sin = table()[5, 1], table()[5, 33]  # pair 1 of token 1: values 450 and 451
    even, odd = x[1, 0, 450], x[1, 0, 451]
    assert torch.isclose(turned[1, 0, 450], even * cos - odd * sin, atol=1e-6)
    assert torch.isclose(turned[1, 0, 451], even * sin + odd * cos, atol=1e-6)
    assert torch.allclose(rope.rotate(turned, pos, table(), inverse=True), x, atol=1e-5)


def test_routing_weights_are_the_chosen_scores_renormalized_and_scaled():
    logits = torch.randn(4, 16, generator=gen)
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    experts = torch.tensor([[0, 3], [1, 2], [5, 15], [7, 8]], dtype=torch.int32)
    weights, ids = routing.hash_topk(logits, experts, 1.5)
    assert torch.equal(ids, experts)
    chosen = scores.gather(-1, experts.long())
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True) * 1.5)
    bias = torch.zeros(16)
    bias[9] = 100.0  # expert 9 always picked, weighted by its score alone
    weights, ids = routing.biased_topk(logits, bias, 3, 1.0)
    assert (ids == 9).any(-1).all()
    best = torch.topk(scores + bias, 3).indices
    assert torch.equal(ids.long().sort(-1).values, best.sort(-1).values)
    assert torch.allclose(weights.sum(-1), torch.ones(4))


def test_a_c4_entry_is_the_softmax_weighted_window_over_both_halves():
    """Token 7 ends window 1 (ratio 4): tokens 0-3 lend their first halves, 4-7 their
    second, per channel softmax(score + ape) weighting the values; token 3's window has
    only its own four tokens (positions before 0 take no weight)."""
    width, ratio, n = 8, 4, 8
    kv = torch.randn(n, 2 * width, generator=gen)
    score = torch.randn(n, 2 * width, generator=gen)
    ape = torch.randn(ratio, 2 * width, generator=gen)
    state = torch.zeros(3, 4, 4 * width)
    pos = torch.arange(n)
    compressor.save_states(kv, score, ape, pos, state, pos + 4)  # block 0 left free
    assert torch.equal(state[1, 2, : 2 * width], kv[2])
    assert torch.equal(state[1, 2, 2 * width :], score[2] + ape[2])
    window = (pos[:, None] - 7 + torch.arange(8)).clamp(min=-5)  # token 3 and 7's windows
    gather = torch.where(window >= 0, window + 4, -1)
    got = compressor.compress(state, gather[[3, 7]], ratio, width)
    halves = torch.arange(8) >= ratio
    s = torch.where(halves[:, None], score[:, width:], score[:, :width]) + torch.where(
        halves[:, None], ape.repeat(2, 1)[:, width:], ape.repeat(2, 1)[:, :width]
    )
    v = torch.where(halves[:, None], kv[:, width:], kv[:, :width])
    assert torch.allclose(got[1], (torch.softmax(s, 0) * v).sum(0), atol=1e-6)
    # token 3: window positions -4..3; 0..3 sit in the current half
    current = torch.softmax(score[:4, width:] + ape[:, width:], 0)
    assert torch.allclose(got[0], (current * kv[:4, width:]).sum(0), atol=1e-6)


def test_only_tokens_ending_a_window_store_an_entry():
    width, ratio, n = 512, 128, 256
    kv, score = torch.randn(n, width, generator=gen), torch.randn(n, width, generator=gen)
    state = torch.zeros(n // 8, 8, 2 * width)
    pos = torch.arange(n)
    compressor.save_states(kv, score, torch.zeros(ratio, width), pos, state, pos)
    gather = (pos[:, None] - ratio + 1 + torch.arange(ratio)).clamp(min=-1)
    entries = torch.full((n,), 3)  # every token asks for slot 3; only 127 and 255 write
    entries[127] = 1
    cache = torch.zeros(1, 4 * DSV4_RECORD, dtype=torch.uint8)
    weight, cos_sin = torch.ones(width), table(n)
    compressor.store_entries(state, gather, pos, entries, weight, 1e-6, cos_sin, cache, 4, ratio)
    written = record.read(cache, torch.tensor([0, 1, 2, 3]), 4)
    assert written[[0, 2]].eq(0).all() and written[1].abs().sum() > 0
    mean = (torch.softmax(score[:128], 0) * kv[:128]).sum(0)
    normed = mean * torch.rsqrt(mean.pow(2).mean() + 1e-6)
    assert torch.allclose(written[1, :448], normed[:448], rtol=2**-4, atol=2**-9)


def test_indexer_queries_fold_their_power_of_two_scale_into_the_weights():
    q = torch.randn(3, 2, 128, generator=gen) * torch.tensor([1e-7, 1.0, 300.0])[:, None, None]
    pos, w = torch.tensor([0, 1, 2]), torch.randn(3, 2, generator=gen)
    values, folded = indexer.quantize_queries(q, pos, table(), w, 0.5, 0.25)
    scale = folded / (w * 0.5 * 0.25)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    assert torch.allclose(scale[0], torch.full((2,), 2.0 ** math.ceil(math.log2(1e-4 / 448))))
    back = values.float() * scale[..., None]
    rotated = rope.rotate(q, pos, table())
    assert torch.allclose(back[1:], rotated[1:], rtol=2**-4, atol=scale[1:].max() * 2**-9)
