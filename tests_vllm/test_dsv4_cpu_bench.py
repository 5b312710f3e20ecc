"""benchmarks/dsv4_cpu.py runs small: vLLM CPU's V4 kernels and ours side by side.

It times; it asserts nothing about speed. This checks that each op was timed on both
sides, that the AVX2 figures came from a process capped at AVX2 (where vLLM's kernels are
absent, so what ran there was ours), and that the ratios are the figures'.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mla.vllm.sparse import dsv4_ops

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    not dsv4_ops.vllms("flash_mla_with_kvcache_cpu"), reason="vLLM's V4 kernels are absent here"
)


def test_dsv4_cpu_bench_times_both_sides(tmp_path):
    out = tmp_path / "dsv4.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "dsv4_cpu.py"),
            *("--tokens", "1", "--heads", "2", "--calls", "1", "--rounds", "1"),
            *("--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["shape"]["heads"] == 2
    assert report["avx2_process"] == {"isa": "avx2", "vllm_kernels": []}
    figures = report["ms_per_call"]
    assert set(figures) == {"attention", "indexer_logits", "indexer_top512"}
    for row in figures.values():
        assert all(row[side] > 0 for side in ("vllm", "ours", "ours_avx2"))
        assert row["ours/vllm"] == pytest.approx(row["ours"] / row["vllm"])
        assert row["ours_avx2/vllm"] == pytest.approx(row["ours_avx2"] / row["vllm"])
