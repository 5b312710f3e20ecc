"""The sparse-MLA GPU benchmark's correctness gate runs on CPU too (Triton interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sparse_mla_bench_smoke(tmp_path):
    out = tmp_path / "sparse_mla.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sparse_mla.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["checks"] and all(c["ok"] for c in report["checks"])
    assert {c["fmt"] for c in report["checks"]} == {"fp8_ds_mla", "bf16"}
    assert out.with_suffix(".md").read_text().startswith("# Sparse MLA")
