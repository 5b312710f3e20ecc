"""Run a benchmark script against the installed vLLM, as its own process; its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, out: Path, *args: str, timeout: int = 600) -> dict:
    """``benchmarks/<script> *args --out out``; asserts exit 0, returns the JSON report."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())
