"""Our kpool indexer reference against transformers' GLM-5.3-Flash indexer
(``transformers.models.glm5_next.modeling_glm5_next.Glm5NextTextIndexer``) on a tiny
config: the same selection from the same projections.

Counting ties: per token, the pools one side selects and the other does not are the
difference; each differing pool must lie at the boundary, i.e. its exact (float64) score
within ``tol`` of the exact score of the last pool selected (the error model of each
test states ``tol``); a differing pool farther away fails. The tails (the incomplete
pool) must be identical.
"""

from __future__ import annotations

import pytest
import torch

from vllm_mla.formats import INDEX_HEAD_DIM
from vllm_mla.ops.kpool_indexer import reference as ref

transformers_glm5 = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
Glm5NextTextConfig = transformers_glm5.Glm5NextTextConfig

HIDDEN, HEADS, Q_LORA = 64, 4, 32


def tiny_indexer(topk: int, kpool: int, *, seed: int):
    config = Glm5NextTextConfig(
        hidden_size=HIDDEN,
        index_n_heads=HEADS,
        index_head_dim=INDEX_HEAD_DIM,
        index_topk=topk,
        index_kpool=kpool,
        q_lora_rank=Q_LORA,
        num_hidden_layers=2,
    )
    indexer = transformers_glm5.Glm5NextTextIndexer(config, 0).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in indexer.named_parameters():
            scale = 1.0 if name.startswith(("index_kpool", "k_norm")) else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return indexer


def projections(indexer, hidden, q_resid):
    """(q [T, H, 128], weights [T, H], k [T, 128], gate [T, 128]) as the indexer makes them."""
    with torch.no_grad():
        q = indexer.wq_b(q_resid).view(-1, HEADS, INDEX_HEAD_DIM)
        k = indexer.k_norm(indexer.wk(hidden))
        gate = torch.nn.functional.linear(hidden, indexer.index_kpool_compress_gate)
        weights = indexer.weights_proj(hidden).float()
    return q, weights, k, gate


def exact_pool_scores(q, weights, k, gate, ape):
    """float64 ``[T, P]`` scores of every complete pool, the independent formulation."""
    kpool = ape.shape[0]
    n = k.shape[0] // kpool * kpool
    kd, gd = k[:n].double(), gate[:n].double()
    probs = torch.softmax(gd.view(-1, kpool, INDEX_HEAD_DIM) + ape.double(), dim=1)
    pools = (probs * kd.view(-1, kpool, INDEX_HEAD_DIM)).sum(1)
    dots = torch.einsum("thd,pd->thp", q.double(), pools).relu()
    return torch.einsum("th,thp->tp", weights.double(), dots) * (INDEX_HEAD_DIM * HEADS) ** -0.5


def count_boundary_ties(ours, theirs, scores, topk, kpool, tol):
    """(exact ties, near ties): differing pools whose exact score equals the boundary
    (relu makes many 0.0; ours must then hold the lower pools) or lies within ``tol`` of
    the row's largest score from it; asserts every differing pool is one of the two."""
    exact = near = 0
    for t in range(ours.shape[0]):
        a = {int(x) // kpool for x in ours[t, :topk] if x >= 0}
        b = {int(x) // kpool for x in theirs[t, :topk] if x >= 0}
        assert len(a) == len(b), (t, sorted(a), sorted(b))
        if a == b:
            continue
        visible = scores[t, : (t + 1) // kpool]
        boundary = float(visible.sort(descending=True).values[len(a) - 1])
        tied = {g for g in a ^ b if float(scores[t, g]) == boundary}
        assert not tied or max(tied & a, default=-1) < min(tied & b, default=len(visible))
        for g in a ^ b - tied:
            gap = abs(float(scores[t, g]) - boundary)
            assert gap <= tol * float(visible.abs().max()), (t, g, gap, sorted(a), sorted(b))
        exact += len(tied)
        near += len(a ^ b) - len(tied)
    return exact, near


@pytest.mark.parametrize(("topk", "kpool", "tokens", "seed"), [(16, 4, 45, 0), (8, 2, 33, 1)])
def test_unquantized_selection_equals_transformers(topk, kpool, tokens, seed):
    indexer = tiny_indexer(topk, kpool, seed=seed)
    gen = torch.Generator().manual_seed(100 + seed)
    hidden = torch.randn(1, tokens, HIDDEN, generator=gen)
    q_resid = torch.randn(1, tokens, Q_LORA, generator=gen)
    mask = torch.ones(1, tokens, dtype=torch.bool)
    with torch.no_grad():
        theirs = indexer(hidden, q_resid, mask, None)[0]
    assert theirs.shape == (tokens, topk + kpool - 1)
    q, weights, k, gate = projections(indexer, hidden[0], q_resid[0])
    ape = indexer.index_kpool_compress_ape.detach().float()
    ours = ref.dense_topk(q, weights, k, gate, ape, topk, quantize=False)
    assert ours.shape == (tokens, ref.output_width(topk, kpool))
    assert (ours[:, topk + kpool - 1 :] == -1).all()
    assert torch.equal(ours[:, topk : topk + kpool - 1], theirs[:, topk:])  # the tails
    scores = exact_pool_scores(q, weights, k, gate, ape)
    # Both sides compute in fp32 and differ in the order of <= 128 + HEADS + kpool sums
    # (dots, heads, pool), each rounding by <= 2**-24 relative: ~1e-5 of the largest
    # score; 1e-4 leaves 10x. A differing pool farther from the boundary fails.
    exact, near = count_boundary_ties(ours, theirs, scores, topk, kpool, tol=1e-4)
    assert near == 0  # random data: no two distinct scores lie that close
    assert exact <= 2 * tokens  # all-negative dots tie at 0.0; each swaps one pair


def test_quantized_selection_differs_from_transformers_only_within_the_fp8_bound():
    topk, kpool, tokens = 16, 4, 64
    indexer = tiny_indexer(topk, kpool, seed=3)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, tokens, HIDDEN, generator=gen)
    q_resid = torch.randn(1, tokens, Q_LORA, generator=gen)
    with torch.no_grad():
        theirs = indexer(hidden, q_resid, torch.ones(1, tokens, dtype=torch.bool), None)[0]
    q, weights, k, gate = projections(indexer, hidden[0], q_resid[0])
    ape = indexer.index_kpool_compress_ape.detach().float()
    ours = ref.dense_topk(
        q.bfloat16(), weights, k.bfloat16(), gate.bfloat16(), ape, topk, quantize=True
    )
    assert torch.equal(ours[:, topk : topk + kpool - 1], theirs[:, topk:])
    scores = exact_pool_scores(q, weights, k, gate, ape)
    # Each rotated vector carries e4m3 rounding (<= 2**-4 relative, 3 mantissa bits),
    # bf16 roundings of q, k, gate, the pool and the rotation (<= 5 * 2**-9) and e4m3
    # subnormals (<= 2**-10 * scale * sqrt(128) <= 0.0005 of its norm): <= 0.074 of its
    # norm; by Cauchy-Schwarz a dot moves by <= (1.074**2 - 1) ~ 0.154 of |q||k| and relu
    # is 1-Lipschitz. Bounded here against the row's largest score (|q||k| of the random
    # rows is within ~3x of it): tol 0.5.
    exact, near = count_boundary_ties(ours, theirs, scores, topk, kpool, tol=0.5)
    assert exact + near <= tokens  # a swapped pair every other token at most
