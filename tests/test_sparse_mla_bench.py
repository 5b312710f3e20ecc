"""The sparse-MLA GPU benchmark's correctness gate runs on CPU too (Triton interpreter)."""

from __future__ import annotations

from benchsmoke import run_smoke

from vllm_mla.ops.sparse_mla import KV_FORMATS


def test_sparse_mla_bench_smoke(tmp_path):
    out = tmp_path / "sparse_mla.json"
    report = run_smoke("sparse_mla.py", out)
    assert report["ok"] and report["checks"] and all(c["ok"] for c in report["checks"])
    assert {c["fmt"] for c in report["checks"]} == set(KV_FORMATS)
    assert [w["mismatched_bytes"] for w in report["writer"]] == [0]  # the nvfp4 writer
    assert out.with_suffix(".md").read_text().startswith("# Sparse MLA")
