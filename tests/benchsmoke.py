"""Run a GPU benchmark script in its --smoke CPU mode (Triton interpreter); its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_smoke(script: str, out: Path, timeout: int = 300) -> dict:
    """``benchmarks/<script> --smoke --out out``; asserts exit 0, returns the JSON report."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())
