"""benchmarks/dsv4_cpu.py runs small: vLLM CPU's V4 kernels and ours side by side.

It times; it asserts nothing about speed. This checks that each op was timed on both
sides, that the AVX2 figures came from a process capped at AVX2 (where vLLM's kernels are
absent, so what ran there was ours), and that the ratios are the figures'.
"""

from __future__ import annotations

import pytest
from benchrun import run_benchmark

from vllm_mla.vllm.sparse import dsv4_ops

pytestmark = pytest.mark.skipif(
    not dsv4_ops.vllms("flash_mla_with_kvcache_cpu"), reason="vLLM's V4 kernels are absent here"
)


def test_dsv4_cpu_bench_times_both_sides(tmp_path):
    report = run_benchmark(
        "dsv4_cpu.py",
        tmp_path / "dsv4.json",
        *("--tokens", "1", "--heads", "2", "--calls", "1", "--rounds", "1"),
    )
    assert report["avx2_process"] == {"isa": "avx2", "vllm_kernels": []}
    figures = report["ms_per_call"]
    assert set(figures) == {"attention", "indexer_logits", "indexer_top512"}
    for row in figures.values():
        assert all(row[side] > 0 for side in ("vllm", "ours", "ours_avx2"))
        assert row["ours/vllm"] == pytest.approx(row["ours"] / row["vllm"])
        assert row["ours_avx2/vllm"] == pytest.approx(row["ours_avx2"] / row["vllm"])
