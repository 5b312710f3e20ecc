"""`vllm-mla soak`: every check counts over every cycle, and each one can fail."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from vllm_mla.tools import cli, soak
from vllm_mla.tools.qualify import QualifyError
from vllm_mla.tools.soak import SoakConfig, run_soak
from vllm_mla.weights import post_load


def test_the_default_soak_is_clean():
    """The issue's target: 1,000 CPU cycles, zero moves, mismatches and ledger growth."""
    report = run_soak(SoakConfig(device="cpu"))
    assert report.cycles == 1000
    assert report.as_dict() | {"elapsed_s": 0} == {
        "cycles": 1000,
        "layers": 2,
        "weights": "fp8-block-deepgemm",
        "device": "cpu",
        "pointer_moves": 0,
        "value_mismatches": 0,
        "ledger_growth_bytes": 0,
        "allocated_growth_bytes": None,
        "replay_mismatches": None,
        "resident_bytes": report.resident_bytes,
        "failures": [],
        "elapsed_s": 0,
        "ok": True,
    }
    assert report.resident_bytes > 0


@pytest.mark.parametrize(
    ("weights", "absorbed", "release"),
    [
        ("mxfp8-flashinfer", "bf16", True),
        ("mxfp8-b12x", "bf16", True),
        ("fp8-block", "bf16", False),
        ("bf16", "bf16", True),
        ("mxfp8-flashinfer", "direct", False),
    ],
)
def test_other_forms_soak_clean(weights, absorbed, release):
    report = run_soak(
        SoakConfig(cycles=6, weights=weights, absorbed=absorbed, release=release, device="cpu")
    )
    assert report.ok, report.failures


def _patched(monkeypatch, after):
    """Run ``after(layer, calls)`` after every post-load the soak makes."""
    calls = [0]

    def wrapped(layer, act, config):
        result = post_load(layer, act, config)
        calls[0] += 1
        after(layer, calls[0])
        return result

    monkeypatch.setattr(soak, "post_load", wrapped)


def test_a_moved_pair_is_counted(monkeypatch):
    old = []  # kept alive, so the allocator cannot hand a moved pair its old address back

    def move(layer, n):
        if n > 2:  # after the first post-load of each layer: a reload that reallocates
            old.append(layer.W_UV)
            layer._parameters["W_UV"] = torch.nn.Parameter(layer.W_UV.clone(), False)

    _patched(monkeypatch, move)
    report = run_soak(SoakConfig(cycles=3, device="cpu"))
    assert report.pointer_moves == 3 * 2 and not report.ok
    assert report.value_mismatches == 0 and report.ledger_growth_bytes == 0
    assert "pair addresses moved" in report.failures[0]


def test_stale_values_are_counted(monkeypatch):
    def stale(layer, n):
        if n > 2:
            layer.W_UK_T.zero_()

    _patched(monkeypatch, stale)
    report = run_soak(SoakConfig(cycles=4, device="cpu"))
    assert report.value_mismatches == 4 * 2 and report.pointer_moves == 0
    assert "differs from a fresh build" in report.failures[0]


def test_ledger_growth_is_counted(monkeypatch):
    """A reload that forgets to release the new source: its bytes show up as growth."""
    calls = [0]

    def keeps_source(layer, act, config):
        calls[0] += 1
        if calls[0] > 2:
            config = dataclasses.replace(config, release_source=False)
        return post_load(layer, act, config)

    monkeypatch.setattr(soak, "post_load", keeps_source)
    report = run_soak(SoakConfig(cycles=3, device="cpu"))
    # fp8 values of two [1024, 512] kv_b_proj (4 heads of DeepSeek-V2-Lite) plus scales
    assert 2 * 1024 * 512 < report.ledger_growth_bytes < 2 * 1024 * 512 * 1.01
    assert report.pointer_moves == 0 and report.value_mismatches == 0
    assert "ledger" in report.failures[0]


def test_failures_kept_are_bounded_but_counts_are_not(monkeypatch):
    _patched(monkeypatch, lambda layer, n: layer.W_UK_T.zero_() if n > 2 else None)
    report = run_soak(SoakConfig(cycles=10, device="cpu"))
    assert report.value_mismatches == 20 and len(report.failures) == soak.MAX_RECORDED


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("cycles", 0, "--cycles"),
        ("layers", 0, "--layers"),
        ("pool", 1, "--pool"),
        ("weights", "int4", "--weights"),
        ("dtype", "float16", "--dtype"),
        ("absorbed", "fp4", "--absorbed"),
    ],
)
def test_bad_settings_are_named(field, value, named):
    with pytest.raises(QualifyError, match=named):
        run_soak(SoakConfig(device="cpu", **{field: value}))


def test_direct_needs_an_mxfp8_pack():
    with pytest.raises(QualifyError, match="MXFP8 pack"):
        run_soak(SoakConfig(device="cpu", absorbed="direct", weights="fp8-block"))


def test_cli_soak(capsys):
    assert cli.main(["soak", "--cycles", "2", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["cycles"] == 2
    assert cli.main(["soak", "--cycles", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "pointer_moves = 0" in out and "ok" in out.splitlines()[-1]
    assert cli.main(["soak", "--cycles", "0", "--device", "cpu"]) == 2
    assert "--cycles must be >= 1" in capsys.readouterr().err


def test_cli_soak_fails_with_exit_1(monkeypatch, capsys):
    _patched(monkeypatch, lambda layer, n: layer.W_UK_T.zero_() if n > 2 else None)
    assert cli.main(["soak", "--cycles", "2", "--device", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out
