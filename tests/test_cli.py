"""`vllm-mla qualify`: JSON contract, figures, checks and exit codes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_mla.geometry import preset
from vllm_mla.tools import qualify as qualify_mod
from vllm_mla.tools.cli import main
from vllm_mla.tools.standins import checkpoint_tensors, synthetic_weight

SIDE_KEYS = {
    "absorbed_bytes": int,
    "source_bytes": int,
    "resident_bytes": int,
    "peak_transient_bytes": (int, type(None)),
    "reserved_unallocated_bytes": (int, type(None)),
}
CHECK_KEYS = {
    "parity_max_abs_err": float,
    "parity_ok": bool,
    "source_released": bool,
    "reload_pointers_stable": bool,
    "regenerated_after_release": bool,
}
SMALL = ["--preset", "deepseek-v2-lite", "--tp", "2", "--layers", "2", "--device", "cpu"]


def run_json(capsys, *args):
    code = main(["qualify", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_json_schema_1(capsys):
    code, report = run_json(capsys, *SMALL)
    assert code == 0
    top = {
        "schema": int,
        "preset": str,
        "tp": int,
        "heads_per_rank": int,
        "layers": int,
        "weights": str,
        "device": str,
        "reclaimed_bytes": int,
    }
    for key, kind in top.items():
        assert isinstance(report[key], kind), key
    for side in ("baseline", "lean"):
        for key, kind in SIDE_KEYS.items():
            assert isinstance(report[side][key], kind), (side, key)
    for key, kind in CHECK_KEYS.items():
        assert isinstance(report["checks"][key], kind), key
    assert report["schema"] == 1 and report["device"] == "cpu"
    assert report["weights"] == "mxfp8-flashinfer" == report["form"]["name"]
    assert "FlashInferCutlassMxfp8LinearKernel" not in report["form"]["vllm"]  # names, not classes
    assert report["form"]["upstream"] == "apply-eye" and report["form"]["scratch_bounded"]
    assert (report["preset"], report["tp"], report["heads_per_rank"], report["layers"]) == (
        "deepseek-v2-lite",
        2,
        8,
        2,
    )


def test_default_geometry_figures(capsys):
    """glm-5 TP4 MXFP8 (FlashInfer CUTLASS layout): per layer the reclaimed bytes are exactly
    the MXFP8 source; upstream's transient is its identity GEMM (a bf16 [K, K] identity and
    its MXFP8 quantization), ours the bounded decode scratch."""
    code, report = run_json(capsys, "--layers", "2", "--device", "cpu")
    rows, cols = 16 * (192 + 256), 512
    source = rows * cols + rows * cols // 32  # e4m3 values + uint8 scales
    assert code == 0 and report["heads_per_rank"] == 16
    assert report["baseline"]["source_bytes"] == 2 * source
    assert report["lean"]["source_bytes"] == 0
    assert report["reclaimed_bytes"] == 2 * source
    assert (
        report["lean"]["absorbed_bytes"]
        == report["baseline"]["absorbed_bytes"]
        == 2 * rows * cols * 2
    )
    lean_peak, base_peak = (
        report["lean"]["peak_transient_bytes"],
        report["baseline"]["peak_transient_bytes"],
    )
    assert 0 < lean_peak <= report["scratch_bound_bytes"]
    identity = cols * cols * 2 + cols * cols + cols * cols // 32  # bf16, e4m3, E8M0
    assert identity <= base_peak < report["scratch_bound_bytes"]
    checks = report["checks"]
    assert checks["parity_max_abs_err"] == 0.0 and all(
        checks[k]
        for k in (
            "parity_ok",
            "source_released",
            "reload_pointers_stable",
            "regenerated_after_release",
        )
    )


@pytest.mark.parametrize("weights", ["bf16", "fp8-block"])
def test_other_formats(capsys, weights):
    code, report = run_json(capsys, *SMALL, "--weights", weights)
    assert code == 0 and report["weights"] == weights and report["checks"]["parity_ok"]
    if weights == "bf16":  # upstream aliases a bf16 source: nothing to reclaim
        assert report["reclaimed_bytes"] == 0


@pytest.mark.parametrize("weights", ["mxfp8", "mxfp8-flashinfer", "mxfp8-b12x"])
def test_direct_counts_the_pack_once_and_no_pair(capsys, weights):
    code, report = run_json(capsys, *SMALL, "--weights", weights, "--absorbed", "direct")
    _, bf16 = run_json(capsys, *SMALL, "--weights", weights)
    assert code == 0 and report["absorbed"] == "direct" and report["checks"]["parity_ok"]
    lean = report["lean"]
    assert lean["source_bytes"] == 0 and lean["peak_transient_bytes"] < 1 << 20
    # the pack (deepseek-v2-lite: P = V = 128, L = 512): one e4m3 byte per element plus
    # one E8M0 byte per 32, for every layer
    pack = report["layers"] * report["heads_per_rank"] * (128 + 128) * 512 * 33 // 32
    assert lean["absorbed_bytes"] == pack
    assert bf16["lean"]["absorbed_bytes"] == 2 * pack * 32 // 33  # the BF16 pair
    assert report["checks"]["reload_pointers_stable"] and report["checks"]["reload_values_correct"]


def test_mha_prefill_keeps_the_source_and_says_why(capsys):
    code, report = run_json(capsys, *SMALL, "--mha-prefill")
    assert code == 0
    assert report["lean"]["source_bytes"] == report["baseline"]["source_bytes"] > 0
    assert report["reclaimed_bytes"] == 0
    assert not report["checks"]["source_released"]
    assert any("MHA prefill" in note for note in report["notes"])
    assert report["checks"]["reload_pointers_stable"]


def test_padded_tp(capsys):
    code, report = run_json(
        capsys,
        "--preset",
        "kimi-k2",
        "--tp",
        "6",
        "--rank",
        "5",
        "--layers",
        "1",
        "--device",
        "cpu",
    )
    assert code == 0 and report["heads_per_rank"] == 11 and report["real_heads"] == 9


def test_checkpoint(tmp_path, capsys):
    geo = preset("deepseek-v2-lite").shard(1)
    tensors = {}
    for i in range(2):
        for name, t in checkpoint_tensors(
            synthetic_weight(geo, seed=9, layer=i), "fp8-block"
        ).items():
            tensors[f"model.layers.{i}.self_attn.kv_b_proj.{name}"] = t
    save_file(tensors, str(tmp_path / "model.safetensors"))
    code, report = run_json(capsys, *SMALL, "--checkpoint", str(tmp_path))
    # a block-FP8 checkpoint is modelled as vLLM serves it on H100/H200 by default: DeepGEMM
    assert code == 0 and report["weights"] == "fp8-block-deepgemm" and report["layers"] == 2
    assert report["checks"]["parity_ok"] and report["source"] == str(tmp_path)


def test_human_table(capsys):
    assert main(["qualify", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "reclaimed" in out and "baseline" in out and "parity_ok" in out


def test_failed_check_exits_1(capsys, monkeypatch):
    monkeypatch.setattr(qualify_mod, "max_abs_err", lambda a, b: 1.0)
    code, report = run_json(capsys, *SMALL)
    assert code == 1 and report["checks"]["parity_ok"] is False


def test_moved_pointers_fail_the_reload_check(capsys, monkeypatch):
    from vllm_mla.weights import absorb

    monkeypatch.setattr(absorb, "_incompatibility", lambda tensor, shape, plan: "forced")
    code, report = run_json(capsys, *SMALL)
    assert code == 1
    assert report["checks"]["reload_pointers_stable"] is False
    assert report["checks"]["parity_ok"] and report["checks"]["reload_values_correct"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "llama"], "unknown preset 'llama'"),
        (["--tp", "0"], "tp must be a positive int"),
        (["--tp", "1000"], "tp=1000 exceeds num_heads=64"),
        (["--layers", "0"], "--layers must be positive"),
        (["--checkpoint", "/nonexistent/ckpt"], "checkpoint path does not exist"),
        (["--weights", "int4"], "invalid choice"),
        (["--max-scratch-mib", "0.001"], "max_scratch_bytes=1048 is below"),
        (["--weights", "fp8-block", "--absorbed", "direct"], "--absorbed direct serves an MXFP8"),
        (["--absorbed", "fp8"], "invalid choice"),
    ],
)
def test_bad_settings_exit_2_with_one_line(capsys, args, message):
    code = main(["qualify", "--device", "cpu", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("vllm-mla: error:") and message in err


def test_console_script_error_has_no_traceback():
    exe = Path(sys.executable).parent / "vllm-mla"
    result = subprocess.run(
        [str(exe), "qualify", "--preset", "nope"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "vllm-mla: error: unknown preset 'nope' "
        "(known: deepseek-v2-lite, deepseek-v3, glm-5, kimi-k2)"
    )


def test_cuda_without_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["qualify", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "config", "spelled_otherwise"),
    [
        (["qualify"], "QualifyConfig", {"release", "max_scratch_bytes"}),
        # library-only: the CLI keeps their defaults
        (
            ["make-model", "/tmp/x"],
            "TinyModelSpec",
            {"intermediate", "max_position", "index_head_dim"},
        ),
        (["soak"], "SoakConfig", {"release", "replay", "max_scratch_bytes"}),
    ],
)
def test_every_config_field_is_an_option_of_the_same_name(command, config, spelled_otherwise):
    """``_from_args`` fills a config from the options named as its fields: a field without
    one would silently keep its default whatever the user passed (the others are listed:
    spelled another way, or library-only)."""
    from vllm_mla.tools import cli

    cls = getattr(cli, config)
    args = cli._parser().parse_args(command)
    names = {f.name for f in dataclasses.fields(cls)}
    missing = {n for n in names - spelled_otherwise if not hasattr(args, n)}
    assert not missing, f"{config} fields without a --option of the same name: {missing}"
    # and _from_args carries each option's value into its field (a mirror dataclass takes
    # any value, so every option can hold a distinct marker)
    mirror = dataclasses.make_dataclass("Mirror", [(n, object, None) for n in names])
    for n in names - spelled_otherwise:
        setattr(args, n, f"marker {n}")
    extra = {n: f"given {n}" for n in spelled_otherwise}
    made = cli._from_args(mirror, args, **extra)
    assert all(getattr(made, n) == f"marker {n}" for n in names - spelled_otherwise)
    assert all(getattr(made, n) == f"given {n}" for n in spelled_otherwise)
