"""The GPU benchmark's correctness gate runs on CPU too (Triton interpreter), so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_query_path_smoke(tmp_path):
    out = tmp_path / "query_path.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "query_path.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    assert {c["weights"] for c in report["checks"]} == {"bf16", "mxfp8"}
