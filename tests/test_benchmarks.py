"""The GPU benchmark's correctness gate runs on CPU too (Triton interpreter), so it cannot rot."""

from __future__ import annotations

from benchsmoke import run_smoke


def test_query_path_smoke(tmp_path):
    out = tmp_path / "query_path.json"
    report = run_smoke("query_path.py", out)
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    assert {c["weights"] for c in report["checks"]} == {"bf16", "mxfp8"}
