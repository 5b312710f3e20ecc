"""Our torch V4 ops (``vllm_mla.vllm.sparse.dsv4_ops``) against vLLM CPU's own ``_C`` ones
(AVX-512 BF16 hosts), op by op, on the same inputs. Each tolerance is the rounding the
two may do differently, stated beside it."""

from __future__ import annotations

import pytest
import torch

from vllm_mla.formats import DSV4_RECORD
from vllm_mla.ops.dsv4 import record
from vllm_mla.vllm.sparse import dsv4_ops

IMPL = {op.name: op.impl for op in dsv4_ops.OPS}
pytestmark = pytest.mark.skipif(
    not all(dsv4_ops.vllms(name) for name in IMPL),
    reason="vLLM's V4 kernels are absent here (no _C library): nothing to compare with",
)
T, H = 9, 4


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def table(positions: int = 200) -> torch.Tensor:
    angles = torch.arange(positions)[:, None] * 10000.0 ** (-torch.arange(32) / 32)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().contiguous()


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in units of b's bf16 step (2**-8 of its magnitude)."""
    return ((a.float() - b.float()).abs() / (b.float().abs() * 2**-8).clamp_min(1e-30)).max()


def test_qnorm_rope_kv_insert(gen):
    """Queries: the same fp32 RMSNorm and rotation, rounded once to bf16: equal. Records:
    the NoPE bytes and scales equal; RoPE values one bf16 rounding of the same rotation."""
    q = torch.randn(T, H, 512, generator=gen).bfloat16()
    kv = (torch.randn(T, 512, generator=gen) * 3).bfloat16()
    pos = torch.randint(0, 200, (T,), generator=gen)
    slots = torch.randperm(128, generator=gen)[:T]
    caches = [torch.zeros(2, 64 * DSV4_RECORD, dtype=torch.uint8) for _ in range(2)]
    args = (pos, None, slots, table(), H + 2, 1e-6, 64)
    outs = []
    for fn, cache in zip(
        (torch.ops._C.fused_qnorm_rope_kv_insert_cpu, IMPL["fused_qnorm_rope_kv_insert_cpu"]),
        caches,
        strict=True,
    ):
        a = list(args)
        a[1] = cache
        outs.append(fn(q, kv, a[0], a[1], a[2], a[3], a[4], a[5], a[6]))
    assert outs[0].shape == (T, H + 2, 512) and torch.equal(outs[0], outs[1])
    (dv, sv), (do, so) = (record._split(c, 64) for c in caches)
    assert torch.equal(dv[..., :448], do[..., :448]) and torch.equal(sv, so)
    assert bf16_steps(record.read(caches[0], slots, 64), record.read(caches[1], slots, 64)) <= 1


def test_inverse_rope(gen):
    """fp32 both: the same products, summed with or without a fused multiply-add."""
    o = torch.randn(T, H, 512, generator=gen).bfloat16()
    pos = torch.randint(0, 200, (T,), generator=gen)
    theirs = torch.ops._C.inverse_gptj_rope_o_proj_cpu(o, pos, table(), 64)
    ours = IMPL["inverse_gptj_rope_o_proj_cpu"](o, pos, table(), 64)
    assert theirs.dtype == ours.dtype == torch.float32
    assert torch.allclose(theirs, ours, rtol=0, atol=1e-6 * o.float().abs().max())


def test_grouped_o_projection(gen):
    """Each packs ``wo_a`` its own way and multiplies with it: bf16 inputs, fp32 sums, one
    bf16 rounding of the output (at most one step apart where the sums' order differs)."""
    groups, rank, k = 2, 64, 1024
    w = (torch.randn(groups, rank, k, generator=gen) * 0.05).bfloat16()
    x = torch.randn(groups, T, k, generator=gen).bfloat16()
    outs = []
    for pack, bmm in (
        (torch.ops._C.convert_weight_packed, torch.ops._C.bmm_cpu),
        (IMPL["convert_weight_packed"], IMPL["bmm_cpu"]),
    ):
        out = torch.empty(groups, T, rank, dtype=torch.bfloat16)
        bmm(out, x, pack(w.clone()), True, None)
        outs.append(out)
    assert bf16_steps(outs[1], outs[0]) <= 1
    with pytest.raises(NotImplementedError, match=r"weight scale \(FP8 wo_a\) is not served"):
        IMPL["bmm_cpu"](out, x, w, True, torch.ones(1))


def test_hyper_connections(gen):
    """vLLM's torch mHC (ours) against its fused ops: fp32 mixes the same to fp32 summation
    order; the bf16 outputs one rounding apart at most."""
    hc, d = 4, 64
    x = torch.randn(T, hc, d, generator=gen).bfloat16()
    fn = torch.randn(24, hc * d, generator=gen) * 0.05
    scale, base = torch.rand(3, generator=gen) + 0.5, torch.randn(24, generator=gen)
    theirs = torch.ops._C.hc_pre_fused_cpu(x, fn, scale, base, hc, 20, 1e-6, 1e-6)
    ours = IMPL["hc_pre_fused_cpu"](x, fn, scale, base, hc, 20, 1e-6, 1e-6)
    assert bf16_steps(ours[0], theirs[0]) <= 1
    for a, b in zip(theirs[1:], ours[1:], strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    y = torch.randn(T, d, generator=gen).bfloat16()
    post = torch.ops._C.hc_post_fused_cpu(y, x, theirs[1], theirs[2])
    assert bf16_steps(IMPL["hc_post_fused_cpu"](y, x, theirs[1], theirs[2]), post) <= 1
    head_fn = torch.randn(hc, hc * d, generator=gen) * 0.05
    head_scale, head_base = torch.rand(1, generator=gen) + 0.5, torch.randn(hc, generator=gen)
    args = (x, head_fn, head_scale, head_base, 1e-6, 1e-6)
    assert bf16_steps(IMPL["hc_head_fused_cpu"](*args), torch.ops._C.hc_head_fused_cpu(*args)) <= 1


def test_routers(gen):
    """The same experts (as sets: the order within a token's top-k is free) with the same
    fp32 weights to a few ulps."""
    logits = torch.randn(T, 64, generator=gen)
    experts = torch.stack([torch.randperm(64, generator=gen)[:6] for _ in range(T)]).int()
    bias = torch.randn(64, generator=gen) * 0.1
    calls = [
        ("hash_topk_cpu", (logits, experts, 6, "sqrtsoftplus", 0, 64, 1.5)),
        ("biased_topk_cpu", (logits, logits, bias, 6, True, "sqrtsoftplus", 0, 1.5, True)),
    ]
    for name, args in calls:
        (w1, i1), (w2, i2) = getattr(torch.ops._C, name)(*args), IMPL[name](*args)
        s1, s2 = i1.long().sort(-1), i2.long().sort(-1)
        assert i2.dtype == i1.dtype and torch.equal(s1.values, s2.values), name
        assert torch.allclose(w1.gather(-1, s1.indices), w2.gather(-1, s2.indices), atol=1e-6)
        assert torch.allclose(w2.sum(-1), torch.full((T,), 1.5))


def test_sparse_attention_writes_vllms_output(gen):
    """The op wrapper stores our fp32 attention into vLLM's bf16 ``out`` (the attention
    itself: ``test_dsv4_attention_vllm``)."""
    cache = torch.zeros(2, 64 * DSV4_RECORD, dtype=torch.uint8)
    record.write(cache, torch.randn(128, 512, generator=gen), torch.arange(128), 64)
    q = (torch.randn(T, H, 512, generator=gen) * 0.1).bfloat16()
    slots = torch.randint(0, 128, (T, 8), generator=gen)
    sink, none = torch.randn(H, generator=gen), torch.empty(T, 0, dtype=torch.int64)
    outs = [torch.empty(T, H, 512, dtype=torch.bfloat16) for _ in range(2)]
    for fn, out in zip(
        (torch.ops._C.flash_mla_with_kvcache_cpu, IMPL["flash_mla_with_kvcache_cpu"]),
        outs,
        strict=True,
    ):
        fn(out, q, cache, slots, 64, cache, none, 64, sink, 512**-0.5)
    largest = record.read(cache, slots, 64).abs().amax()
    assert (outs[0].float() - outs[1].float()).abs().max() <= 2**-8 * largest


def state_case(gen: torch.Generator, ratio: int, width: int):
    """One request of 300 tokens: its compressor inputs, state slots through a permuted
    block table, each token's window of state slots (vLLM's gather), entry slots."""
    coff = 2 if ratio == 4 else 1
    block = 4 if ratio == 4 else 8  # vLLM's state block sizes
    n = 300
    kv, score = (
        torch.randn(n, coff * width, generator=gen) * 2,
        torch.randn(n, coff * width, generator=gen),
    )
    ape = torch.randn(ratio, coff * width, generator=gen)
    pos = torch.arange(n)
    blocks = (n + block - 1) // block
    table = torch.randperm(blocks + 2, generator=gen)[:blocks]
    slots = table[pos // block] * block + pos % block
    window = pos[:, None] - coff * ratio + 1 + torch.arange(coff * ratio)
    gather = torch.where(
        window >= 0, table[window.clamp_min(0) // block] * block + window.clamp_min(0) % block, -1
    )
    entries = torch.where((pos + 1) % ratio == 0, 0, -1)
    entries[entries == 0] = torch.randperm(256, generator=gen)[: int((entries == 0).sum())]
    state = torch.zeros(blocks + 2, block, 2 * coff * width)
    return kv, score, ape, pos, slots, state, gather, entries


@pytest.mark.parametrize(("ratio", "width"), [(4, 512), (128, 512), (4, 128)])
def test_compressor(gen, ratio, width):
    """States: the same fp32 rows. Entries: the same window softmax, norm and rotation in
    fp32, summed in another order, so a value at a rounding boundary may land one step
    away: at most 0.1% of the values, each by one e4m3 step (2**-3 of its size), one bf16
    step for RoPE values (2**-8), or across the flush to zero (under 2**-6 of the block's
    scale, which is at most 2 * amax / 448: 2**-13 of the row's largest value)."""
    kv, score, ape, pos, slots, state, gather, entries = state_case(gen, ratio, width)
    states = [state.clone(), state.clone()]
    torch.ops._C.save_partial_states_cpu(kv, score, ape, pos, states[0], slots)
    IMPL["save_partial_states_cpu"](kv, score, ape, pos, states[1], slots)
    assert torch.equal(*states) and states[0].count_nonzero() > 0
    name = (
        "compress_norm_rope_store_cpu" if width == 512 else "compress_norm_rope_store_indexer_cpu"
    )
    angles = torch.arange(400)[:, None] * 160000.0 ** (-torch.arange(32) / 32)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).float().contiguous()
    weight = torch.rand(width, generator=gen) + 0.5
    size = DSV4_RECORD if width == 512 else 132
    caches = [torch.zeros(4, 64 * size, dtype=torch.uint8) for _ in range(2)]
    for fn, cache in zip((getattr(torch.ops._C, name), IMPL[name]), caches, strict=True):
        fn(states[0], gather, pos, entries, weight, 1e-6, cos_sin, cache, 64, ratio)
    written = entries[entries >= 0]
    if width == 512:
        a, b = record.read(caches[0], written, 64), record.read(caches[1], written, 64)
    else:
        from vllm_mla.ops.sparse_indexer.reference import read_keys

        ka, sa = read_keys(caches[0].view(4, 64, 132), written)
        kb, sb = read_keys(caches[1].view(4, 64, 132), written)
        assert torch.equal(sa, sb)
        a, b = ka.float() * sa[:, None], kb.float() * sb[:, None]
    moved = a != b
    assert moved.float().mean() <= 1e-3 and a.count_nonzero() > a.numel() // 2
    step = torch.maximum(
        torch.maximum(a.abs(), b.abs()) * 2**-3, a.abs().amax(-1, keepdim=True) * 2**-13
    )
    assert ((a - b).abs() <= step)[moved].all()


def test_indexer_queries(gen):
    """The same per-head power-of-two scales, folded into the weights the same way; the
    rotated values rounded to e4m3 apart by one step where vLLM's rotation rounds
    otherwise (seen: 3% of the rotated half, none of the rest)."""
    t, heads = 7, 4
    angles = torch.arange(100)[:, None] * 160000.0 ** (-torch.arange(32) / 32)
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).float().contiguous()
    pos = torch.randint(0, 100, (t,), generator=gen)
    q = torch.randn(t, heads, 128, generator=gen) * torch.logspace(-6, 1, t)[:, None, None]
    w = torch.randn(t, heads, generator=gen)
    outs = []
    for fn in (torch.ops._C.fused_indexer_q_rope_quant_cpu, IMPL["fused_indexer_q_rope_quant_cpu"]):
        values = torch.empty(t, heads, 128, dtype=torch.float8_e4m3fn)
        weights = torch.empty(t, heads)
        fn(pos, q, cos_sin, values, w, 128**-0.5, heads**-0.5, weights)
        outs.append((values.float(), weights))
    (va, wa), (vb, wb) = outs
    assert torch.equal(wa, wb)
    assert torch.equal(va[..., :64], vb[..., :64])
    moved = va[..., 64:] != vb[..., 64:]
    assert moved.float().mean() <= 0.1
    assert ((va - vb).abs()[..., 64:][moved] <= va.abs()[..., 64:][moved] * 2**-2).all()


def test_indexer_logits_and_top_512(gen):
    """Logits: the same e4m3 products summed in fp32 (within each request's length; vLLM
    leaves the columns past it unspecified, ours are -inf). Top-512: the same positions
    and slots (vLLM's order within the 512 is its own)."""
    from vllm_mla.ops.sparse_indexer.reference import insert_keys

    rows, lengths = 12, torch.tensor([700, 300, 600], dtype=torch.int32)
    tables = torch.stack([torch.randperm(rows, generator=gen) for _ in range(3)]).int()
    cache = torch.zeros(rows, 64, 132, dtype=torch.uint8)
    insert_keys(cache, torch.randn(rows * 64, 128, generator=gen), torch.arange(rows * 64))
    q = (torch.randn(3, 4, 128, generator=gen) * 10).to(torch.float8_e4m3fn)
    w = torch.randn(3, 4, generator=gen)
    args = (q, cache.view(rows, -1), w, lengths, tables, 64, 700)
    theirs, ours = (
        torch.ops._C.fp8_paged_mqa_logits_cpu(*args),
        IMPL["fp8_paged_mqa_logits_cpu"](*args),
    )
    for r, length in enumerate(lengths.tolist()):
        assert torch.allclose(theirs[r, :length], ours[r, :length], rtol=1e-5, atol=1e-4)
        assert torch.isneginf(ours[r, length:]).all()
    picked = []
    for fn in (torch.ops._C.topk_transform_512_cpu, IMPL["topk_transform_512_cpu"]):
        slots, raw = (torch.full((3, 512), 7, dtype=torch.int32) for _ in range(2))
        fn(theirs, lengths, tables, slots, 64, raw)
        picked.append((slots.sort(-1).values, raw.sort(-1).values))
    assert torch.equal(picked[0][0], picked[1][0]) and torch.equal(picked[0][1], picked[1][1])
    assert (picked[0][1][1] == -1).sum() == 512 - 300  # a row shorter than 512: padded
