"""Our DeepSeek-V4 sparse attention (``vllm_mla.ops.dsv4.attention``) against vLLM CPU's
``flash_mla_with_kvcache_cpu`` on the same records (``_C`` only: AVX-512 BF16 hosts)."""

from __future__ import annotations

import pytest
import torch

from vllm_mla.formats import DSV4_RECORD
from vllm_mla.ops.dsv4 import attention, record
from vllm_mla.vllm.sparse import dsv4_ops

pytestmark = pytest.mark.skipif(
    not dsv4_ops.vllms("flash_mla_with_kvcache_cpu"), reason="vLLM's V4 kernels are absent here"
)
T, H, W, C = 9, 4, 16, 24  # queries, heads, window slots, compressed slots
WB, CB = 64, 64  # tokens a page: window cache, compressed cache


def caches(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.zeros(4, WB * DSV4_RECORD, dtype=torch.uint8)
    compressed = torch.zeros(2, CB * DSV4_RECORD, dtype=torch.uint8)
    for cache, blocks, size in ((window, 4, WB), (compressed, 2, CB)):
        rows = torch.randn(blocks * size, 512, generator=gen) * 2
        record.write(cache, rows, torch.arange(blocks * size), size)
    return window, compressed


@pytest.mark.parametrize("with_compressed", [True, False])
def test_vllms_kernel_and_ours_attend_alike(with_compressed):
    """The same records, slots (padded with -1, a row with no compressed entry, one with
    nothing but the sink) and sinks (one head without: -inf). Error model: both read the
    same bf16 queries and decoded rows and take scores and exponentials in fp32; vLLM's
    kernel rounds the probabilities to bf16 for its P.V product and stores bf16 outputs,
    ours stays fp32. Each rounding moves an output by at most 2**-9 of the largest value
    it averages (the probabilities sum to at most 1), so the two differ by at most 2**-8
    of the largest |value| among the row's attended keys (fp32 summation order is far
    below that)."""
    gen = torch.Generator().manual_seed(1)
    window, compressed = caches(gen)
    q = (torch.randn(T, H, 512, generator=gen) * 0.1).bfloat16()
    w_slots = torch.randint(0, 4 * WB, (T, W), generator=gen)
    w_slots[:, W - 3 :] = -1
    c_slots = torch.randint(0, 2 * CB, (T, C), generator=gen)
    c_slots[2] = -1
    w_slots[4], c_slots[4] = -1, -1  # nothing but the sink
    w_slots[4, 0] = 7  # vLLM's kernel needs a window slot column; one token
    sink = torch.randn(H, generator=gen)
    sink[1] = float("-inf")
    scale = 512**-0.5
    out = torch.empty(T, H, 512, dtype=torch.bfloat16)
    args = (c_slots, CB) if with_compressed else (torch.empty(T, 0, dtype=torch.int64), CB)
    torch.ops._C.flash_mla_with_kvcache_cpu(
        out, q, window, w_slots, WB, compressed, args[0], args[1], sink, scale
    )
    ours = attention.attend(q, window, w_slots, WB, compressed, args[0], args[1], sink, scale)
    both = [(window, w_slots, WB)] + ([(compressed, args[0], CB)] if with_compressed else [])
    largest = torch.stack(
        [
            torch.cat([record.read(c, s[t], b)[s[t] >= 0] for c, s, b in both]).abs().max()
            for t in range(T)
        ]
    )
    err = (out.float() - ours).abs().amax(dim=(1, 2)) / largest
    print(f"worst error / largest attended value: {err.max():.2e}")
    assert err.max() <= 2**-8
    # row 4, head 1 (no sink): its one window token alone, weight 1
    assert torch.equal(ours[4, 1], record.read(window, torch.tensor([7]), WB)[0])
    if with_compressed:  # the compressed source counts
        alone = attention.attend(q, window, w_slots, WB, None, None, CB, sink, scale)
        assert (alone - ours).abs().amax() > 0.1
