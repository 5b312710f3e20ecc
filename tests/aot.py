"""Compile Triton kernels for real GPU targets with Triton's bundled ptxas (no GPU) and
check what the compiler reports: the shared part of each kernel file's compile test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SHARED_LIMIT = 99 * 1024  # SM89 and SM12x: shared memory per block
MAX_STACK = 16  # bytes of local frame tolerated (8 seen on sm90/sm120 without spills)


def cubin_usage(compiled) -> str:
    """cuobjdump's resource usage (registers, stack) of a compiled kernel's cubin ("" when
    Triton ships no cuobjdump); the scripts ``compile_report`` runs import it."""
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        args = [tool, "--dump-resource-usage", f.name]
        return subprocess.run(args, capture_output=True, text=True).stdout


def compile_report(script: str, cases: list, timeout: int = 480) -> list[dict]:
    """Run ``script`` (prints one JSON list of per-case reports with ``shared`` and
    cuobjdump's ``usage``: ``from aot import cubin_usage``) outside the interpreter;
    returns that list."""
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (here, env.get("PYTHONPATH"))))
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report) == len(cases)
    return report


def assert_fits(report: list[dict]) -> None:
    """Every case within the shared-memory limit, <= 255 registers, no spills."""
    for r in report:
        assert r["shared"] <= SHARED_LIMIT, r
        if r["usage"]:
            regs = int(r["usage"].split("REG:")[1].split()[0])
            stack = int(r["usage"].split("STACK:")[1].split()[0])
            assert regs <= 255 and stack <= MAX_STACK, r
