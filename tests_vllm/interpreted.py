"""A test script run in a fresh interpreter under Triton's CPU interpreter, which must be
switched on (``TRITON_INTERPRET=1``) before Triton is first imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run(script: str) -> None:
    """Run ``script``; it passes when it exits 0 having printed ``OK``."""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=Path(__file__).parent,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
