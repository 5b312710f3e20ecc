"""The sparse-MLA ownership GPU script runs on CPU too (--smoke), so it cannot rot.

On CPU the census is ledger-style (gc-visible storages) and replays are eager re-runs
of the same binding; the CUDA allocator census and graph replay are GPU-only.
"""

from __future__ import annotations

from benchsmoke import run_smoke


def test_sparse_ownership_bench_smoke(tmp_path):
    out = tmp_path / "sparse_ownership.json"
    report = run_smoke("sparse_ownership.py", out)
    assert report["ok"] and report["checks"] and all(c["ok"] for c in report["checks"])
    assert {c["kv_format"] for c in report["cases"]} == {"fp8_ds_mla", "bf16"}
    names = {c["name"] for c in report["checks"]}
    for expected in (
        "plan allocates nothing",
        "prepare returns to the pre-prepare figure",
        "every probe freed (weakrefs)",
        "profiling bytes returned",
        "old pool and storage unreferenced",
        "prepare after freeze raises",
        "the session keeps nothing of the caller's (scratch freed with the caller's ref)",
        "release(plan) leaves the plan's baseline",
    ):
        assert expected in names, expected
    assert report["replays"] and all(r["ok"] for r in report["replays"])
    assert out.with_suffix(".md").read_text().startswith("# Sparse-MLA ownership")
