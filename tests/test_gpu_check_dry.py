"""`gpu_check.sh essential` before a GPU window: its dry run works end to end on CPU, its
step timeouts fit the 8-minute budget, and the GPU-only timing code runs (on CPU, with the
CUDA-graph timer swapped for an eager call) so a typo cannot cost the window."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
BUDGET_S = 480  # one GPU window's command: at most 8 minutes of step timeouts
sys.path.insert(0, str(ROOT / "benchmarks"))

import essential  # noqa: E402  (benchmarks/ on the path first)


def step_timeouts() -> dict[str, int]:
    text = SCRIPT.read_text()
    spec = re.search(r'^ESSENTIAL_STEPS="([^"]+)"', text, re.M).group(1)
    return {name: int(secs) for name, secs in (kv.split(":") for kv in spec.split())}


def test_step_timeouts_sum_under_eight_minutes():
    timeouts = step_timeouts()
    assert sum(timeouts.values()) < BUDGET_S, timeouts
    body = SCRIPT.read_text()
    # every timed step has a timeout, and every step with a timeout is run by name
    timed = set(re.findall(r"^\s*timed (\w+)", body, re.M))
    assert timed - {"$s"} <= set(timeouts)
    assert set(timeouts) == (timed - {"$s"}) | set(essential.STEPS)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("essential")
    env = {**os.environ, "OUT": str(out), "VLLM_MLA_GPU_DRY": "1", "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # the script sets it for its dry steps itself
    done = subprocess.run(
        ["bash", str(SCRIPT), "essential"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
        check=False,
    )
    return out, done


def test_dry_run_end_to_end(dry_run):
    out, done = dry_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads((out / "essential.json").read_text())
    assert report["dry"] is True
    status = {name: s["status"] for name, s in report["steps"].items()}
    assert status == {
        "machine": "ok",
        "build": "skipped",
        "memcheck": "skipped",
        "query": "dry",
        "sparse": "dry",
        "indexer": "dry",
        "dsv4": "dry",
    }
    assert report["step_timeouts_s"] == step_timeouts()
    names = set()
    for step in essential.STEPS:
        rows = report["steps"][step]["checks"]
        assert rows and all(r["ok"] for r in rows), rows
        names |= {r["name"] for r in rows}
        # correctness ran on CPU; graph capture and timings are marked, not faked
        assert all(r.get("status") == "not run" for r in rows if r.get("graph"))
        assert all(r.get("status") == "not run" for r in report["steps"][step]["timings"])
    assert {"safe_bmm", "absorbed_bmm", "fused_query", "sparse_mla decode"} <= names
    assert {"indexer insert", "indexer logits", "indexer top-k"} <= names
    assert {"dsv4 decode C4", "dsv4 prefill C128"} <= names
    assert "skipped (dry run: no GPU)" in done.stdout  # the GPU parts say so


def test_dry_run_writes_results_rows_and_few_files(dry_run):
    out, _ = dry_run
    files = sorted(p.name for p in out.iterdir())
    # the device tool brings back at most 8 files named in [A-Za-z0-9._-]
    assert files == ["essential.json", "essential.log", "essential.md"]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    rows = (out / "essential.md").read_text()
    assert "DRY RUN" in rows
    header = "| date | GPU | driver | torch | Triton | commit |"
    assert rows.count(header) == 2  # correctness and timings
    assert f"| {torch.__version__} |" in rows
    lines = [line for line in rows.splitlines() if line.startswith("| 20")]
    assert lines and all(line.count("|") in (12, 13) for line in lines)  # no stray pipes
    assert sum("not run (dry)" in line for line in lines) >= 10


def test_report_marks_timeouts_and_failures(tmp_path):
    """A step killed by its timeout keeps its rows and is reported as a timeout; GPU-shaped
    timing rows render with their baseline."""
    data = {
        "env": {
            "date": "2026-12-02",
            "gpu": "NVIDIA H200",
            "driver": "580.1",
            "torch": "2.11",
            "triton": "3.6.0",
            "commit": "abc1234",
        },
        "dry": False,
        "steps": {
            "query": {
                "status": "running",
                "checks": [
                    {
                        "name": "safe_bmm",
                        "shape": "T1",
                        "metric": "rel_err",
                        "value": 1e-3,
                        "bound": 2**-8,
                        "model": "bf16 out rounding",
                        "ok": True,
                    }
                ],
                "timings": [
                    {
                        "name": "safe_bmm vs torch.bmm",
                        "shape": "T1",
                        "ours_us": 5.0,
                        "base": "torch.bmm (strided)",
                        "base_us": 6.0,
                        "ratio": 5 / 6,
                        "ok": True,
                    }
                ],
            },
            "sparse": {
                "status": "failed",
                "checks": [
                    {"name": "sparse_mla decode", "ok": False, "error": "RuntimeError: x | y"}
                ],
                "timings": [],
            },
        },
    }
    (tmp_path / "essential.json").write_text(json.dumps(data))
    rc = essential.report(tmp_path, ["query=124:100", "sparse=1:20"], "query:100 sparse:90")
    assert rc == 1
    got = json.loads((tmp_path / "essential.json").read_text())
    assert got["steps"]["query"]["status"] == "timeout"
    assert got["steps"]["sparse"]["status"] == "failed (exit 1)"
    assert got["step_timeouts_sum_s"] == 190
    rows = (tmp_path / "essential.md").read_text()
    assert "| safe_bmm vs torch.bmm | T1 | 5 | torch.bmm (strided) | 6 | 0.833 |" in rows
    assert "RuntimeError: x / y" in rows and "| NO |" in rows


def test_version_problem_names_the_versions(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0+cu128")
    assert "torch 2.10.0+cu128" in essential.version_problem()
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    import triton

    monkeypatch.setattr(triton, "__version__", "3.5.1")
    assert "Triton 3.5.1" in essential.version_problem()
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert essential.version_problem() is None


@pytest.fixture
def eager_gpu(monkeypatch):
    """CUDA-graph timer, capture and copy bandwidth swapped for eager CPU stand-ins."""
    import common

    calls = []

    def graph_time_us(step, reps=20):
        step()
        calls.append(step)
        return 1.0

    monkeypatch.setattr(common, "graph_time_us", graph_time_us)
    monkeypatch.setattr(common, "copy_bandwidth", lambda device: 1e12)
    monkeypatch.setattr(essential, "capture", lambda step, device: (step(), step)[1])
    return calls


def test_gpu_timing_code_runs(eager_gpu, monkeypatch):
    import decode_path
    import query_path

    cpu = torch.device("cpu")
    monkeypatch.setattr(query_path, "LAYERS", 2)
    row = essential.time_safe_bmm(1, 2, 128, cpu, 1e12)
    assert row["ratio"] == 1.0 and row["roofline_us"] > 0
    monkeypatch.setattr(decode_path, "LAYERS", 1)
    rows = essential.time_decode_path(1, "dsv3-tp8", cpu, 1e12)
    assert [r["ours_us"] for r in rows] == [1.0, 1.0, 1.0] and rows[0]["roofline_us"] > 0
    row = essential._indexer_timing(1, cpu, torch.Generator().manual_seed(0), 1e12, 2, 128)
    assert row["key_bytes"] > 0 and row["ratio"] > 0
    import dsv4_attention

    row = dsv4_attention.time_decode(cpu, torch.Generator().manual_seed(0), 1e12, t=2, h=3)
    assert row["ratio"] > 0 and row["base_us"] > 0
    # every timed closure ran once: safe bmm 3; decode path 3 modes + 2 x (fused, staged);
    # the indexer 1; V4's decode 1
    assert len(eager_gpu) == 3 + 7 + 1 + 1


def test_dsv4_graph_check_runs(eager_gpu):
    import dsv4_attention

    gen = torch.Generator().manual_seed(0)
    row = dsv4_attention.graph_check(essential.capture, torch.device("cpu"), gen, t=2, h=3)
    assert row["ok"] and row["writer_bytes_off"] == 0 and 0 < row["value"] <= 1


def test_indexer_graph_check_runs(eager_gpu):
    row = essential.indexer_graph_check(2, 4, 130, torch.device("cpu"), rounds=2, topk=32)
    assert row["ok"] and row["value"] == 0
