"""The GPU benchmark's correctness gate runs on CPU too (Triton interpreter), so it cannot rot."""

from __future__ import annotations

from benchsmoke import run_smoke


def test_query_path_smoke(tmp_path):
    out = tmp_path / "query_path.json"
    report = run_smoke("query_path.py", out)
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    assert {c["weights"] for c in report["checks"]} == {"bf16", "mxfp8"}


def test_decode_path_smoke(tmp_path):
    report = run_smoke("decode_path.py", tmp_path / "decode_path.json")
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    assert all(c[mode]["pad"] for c in report["checks"] for mode in ("bmm", "safe", "direct"))
    overhead = report["host_overhead"]
    assert overhead["routed_us"] > 0 and overhead["plain_us"] > 0  # measured, not asserted


def test_kv_b_forms_table_covers_every_row(tmp_path):
    import subprocess
    import sys

    from benchsmoke import ROOT

    from vllm_mla.weights.forms import FORM_NAMES

    out = tmp_path / "forms.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "kv_b_forms.py"),
            "--preset",
            "deepseek-v2-lite",
            "--tp",
            "8",
            "--layers",
            "1",
            "--device",
            "cpu",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in FORM_NAMES:
        assert f"| `{name}` |" in result.stdout
    import json

    assert [r["weights"] for r in json.loads(out.read_text())["rows"]] == list(FORM_NAMES)
