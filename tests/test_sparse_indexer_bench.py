"""The indexer GPU script runs on CPU too (--smoke), and its comparison can fail."""

from __future__ import annotations

import sys

import torch
from benchsmoke import ROOT, run_smoke


def test_sparse_indexer_bench_smoke(tmp_path):
    report = run_smoke("sparse_indexer.py", tmp_path / "sparse_indexer.json")
    assert report["ok"] and len(report["checks"]) == 2
    assert all(c["errors"] == 0 for c in report["checks"])
    # the speculative-decoding layouts: native / ragged next_n 2 and flattened next_n 4
    layouts = {(r["layout"], r["next_n"]): r for r in report["layouts"]}
    assert set(layouts) == {("native", 2), ("ragged", 2), ("flat", 4)}
    assert layouts["ragged", 2]["T"] == 6 and layouts["native", 2]["T"] == 8
    assert all(r["ok"] and r["errors"] == 0 for r in layouts.values())


def test_the_comparison_counts_a_wrong_selection_as_an_error():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sparse_indexer as bench

    case = bench.make_case(
        2, 4, 150, torch.device("cpu"), torch.Generator().manual_seed(1), topk=16
    )
    right = bench.ours(case)
    assert bench.compare(case, right)["ok"]
    wrong = right.clone()
    wrong[1, 0] = wrong[1, -1] + 1 if wrong[1, -1] >= 0 else 149  # not a near-tie swap
    wrong[1, 1], wrong[1, 2] = right[1, 2], right[1, 1]  # and out of order
    result = bench.compare(case, wrong)
    assert result["errors"] == 1 and not result["ok"]
