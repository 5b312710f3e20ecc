"""`vllm-mla qualify --plot`: the picture, its marks, the trace behind it, the optional extra."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from vllm_mla.memory import AllocationTrace
from vllm_mla.tools import plot as plot_mod
from vllm_mla.tools.cli import main
from vllm_mla.tools.qualify import QualifyConfig, run_qualify

SMALL = ["--preset", "deepseek-v2-lite", "--tp", "1", "--layers", "2", "--device", "cpu"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small_run():
    timelines: dict = {}
    cfg = QualifyConfig(preset="deepseek-v2-lite", tp=1, layers=2, device="cpu")
    return run_qualify(cfg, timelines=timelines), timelines


def test_plot_writes_a_png_and_says_so(tmp_path, capsys):
    out = tmp_path / "mem.png"
    assert main(["qualify", *SMALL, "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {out}")


def test_plot_with_json_keeps_stdout_pure_json(tmp_path, capsys):
    out = tmp_path / "mem.svg"
    assert main(["qualify", *SMALL, "--json", "--plot", str(out)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["schema"] == 1
    assert f"wrote {out}" in captured.err
    assert out.read_text().lstrip().startswith("<?xml") and "<svg" in out.read_text()


def test_timelines_leave_the_report_unchanged(small_run):
    report, timelines = small_run
    plain = run_qualify(QualifyConfig(preset="deepseek-v2-lite", tp=1, layers=2, device="cpu"))
    assert set(timelines) == {"baseline", "lean"}
    drop = ("elapsed_s",)
    assert {k: v for k, v in plain.items() if k not in drop} == {
        k: v for k, v in report.items() if k not in drop
    }


def test_timeline_agrees_with_the_report(small_run):
    """The curve is the trace the report's peaks come from: its scratch peaks at
    peak_transient_bytes, and with nothing freed from before the phase on CPU, the baseline
    ends where its persistent pair does."""
    report, timelines = small_run
    for phase in ("baseline", "lean"):
        points = timelines[phase]
        assert points and all(tr >= 0 for _, _, tr in points)
        assert max(tr for _, _, tr in points) == report[phase]["peak_transient_bytes"]
        assert points[-1][2] == 0  # every scratch block was freed again
        assert [t for t, _, _ in points] == sorted(t for t, _, _ in points)
    assert timelines["baseline"][-1][1] == report["baseline"]["absorbed_bytes"]


def test_timeline_counts_every_event():
    """live is the running sum of all allocator events; transient only the blocks freed
    again in the window; the end is persistent_bytes() less frees of older blocks."""
    with AllocationTrace("cpu") as trace:
        kept = torch.empty(1 << 20, dtype=torch.uint8)
        scratch = torch.empty(1 << 18, dtype=torch.uint8)
        del scratch
    points = trace.timeline()
    assert [live for _, live, _ in points] == [1 << 20, (1 << 20) + (1 << 18), 1 << 20]
    assert [tr for _, _, tr in points] == [0, 1 << 18, 0]
    assert points[-1][1] == trace.persistent_bytes() == kept.untyped_storage().nbytes()
    assert max(tr for _, _, tr in points) == trace.transient_peak()


def test_marks_are_the_report_figures(small_run, tmp_path):
    report, timelines = small_run
    marks = plot_mod.write_plot(tmp_path / "m.png", report, timelines)
    for phase in ("baseline", "lean"):
        side, mark = report[phase], marks[phase]
        assert mark["pair_bytes"] == side["absorbed_bytes"]
        assert mark["source_bytes"] == side["source_bytes"]
        assert mark["scratch_peak_bytes"] == side["peak_transient_bytes"] > 0
        # the scratch mark sits on the curve, at the first event holding the peak
        _, live, transient = timelines[phase][mark["scratch_event"] - 1]
        assert (live, transient) == (mark["scratch_top_bytes"], side["peak_transient_bytes"])
        earlier = timelines[phase][: mark["scratch_event"] - 1]
        assert all(tr < side["peak_transient_bytes"] for _, _, tr in earlier)
    assert marks["baseline"]["source_bytes"] > 0 and marks["lean"]["source_bytes"] == 0


def test_title_names_the_run(small_run):
    title = plot_mod.plot_title(small_run[0])
    for part in ("deepseek-v2-lite", "TP1", "rank 0", "2 layers", "mxfp8-flashinfer", "cpu"):
        assert part in title


@pytest.mark.parametrize("name", ["mem.jpg", "mem", "missing-folder/mem.png"])
def test_bad_plot_path_is_a_usage_error_before_the_run(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setattr(
        "vllm_mla.tools.cli.run_qualify", lambda *a, **k: pytest.fail("ran before checking --plot")
    )
    assert main(["qualify", *SMALL, "--plot", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-mla: error: --plot") and err.count("\n") == 1


def test_missing_matplotlib_is_a_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setattr(
        "vllm_mla.tools.cli.run_qualify", lambda *a, **k: pytest.fail("ran without matplotlib")
    )
    assert main(["qualify", *SMALL, "--plot", str(tmp_path / "mem.png")]) == 2
    assert capsys.readouterr().err == (
        "vllm-mla: error: --plot needs matplotlib: pip install 'vllm-mla[plot]'\n"
    )
    assert not (tmp_path / "mem.png").exists()


def test_write_plot_without_matplotlib_raises_the_typed_error(small_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    report, timelines = small_run
    with pytest.raises(plot_mod.PlotError, match=r"pip install 'vllm-mla\[plot\]'"):
        plot_mod.write_plot(tmp_path / "m.png", report, timelines)
    assert issubclass(plot_mod.PlotError, ValueError)


def test_importing_the_cli_does_not_import_matplotlib():
    code = "import sys, vllm_mla.tools.cli; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
