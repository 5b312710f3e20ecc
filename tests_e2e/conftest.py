"""End-to-end fixtures: two tiny local checkpoints, engine runs with the plugin off and
on (each its own process), and transformers fp32 as the reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from vllm_mla import cpu_isa
from vllm_mla.tools.tinymodel import TinyModelSpec, make_model

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from engine_job import MAX_TOKENS, PROMPTS  # noqa: E402

ENGINE_TIMEOUT_S = 300
# Engine runs: plugin OFF, and ON with the safe V up-projection forced so the query
# path's replacement is the one serving every decode step.
RUNS = {
    "off": {"VLLM_MLA": "0"},
    "on": {"VLLM_MLA": "1", "VLLM_MLA_SAFE_BMM": "always"},
}


def pytest_configure(config):
    # VLLM_MLA_CPU_ISA is applied at interpreter start-up by the environment's .pth hook
    # (scripts/setup.sh), in every engine job's process too; a bad value stops the run here
    cpu_isa.apply()


def pytest_report_header(config):
    return f"CPU: VLLM_MLA_CPU_ISA={cpu_isa.applied()} (each engine job reports its library)"


TOPOLOGY_TABLE: list[dict] = []  # test_topology's rows, printed (and written) at the end


def pytest_terminal_summary(terminalreporter):
    if not TOPOLOGY_TABLE:
        return
    keys = list(TOPOLOGY_TABLE[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in TOPOLOGY_TABLE]
    terminalreporter.write_sep("=", "topology matrix (vLLM CPU)")
    terminalreporter.write_line("\n".join(lines))
    path = os.environ.get("VLLM_MLA_TOPOLOGY_TABLE")
    if path:
        Path(path).write_text("\n".join(lines) + "\n")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    """``first`` (seed 0) and ``second`` (seed 1, the reload) tiny MLA checkpoints."""
    root = tmp_path_factory.mktemp("models")
    return {
        "first": make_model(root / "first", TinyModelSpec(seed=0)),
        "second": make_model(root / "second", TinyModelSpec(seed=1)),
    }


@pytest.fixture(scope="session")
def sparse_models(tmp_path_factory) -> dict[str, Path]:
    """``first`` and ``second`` tiny DeepSeek-V3.2 (DSA) checkpoints."""
    root = tmp_path_factory.mktemp("sparse-models")
    return {
        "first": make_model(root / "first", TinyModelSpec(seed=0, sparse=True)),
        "second": make_model(root / "second", TinyModelSpec(seed=1, sparse=True)),
    }


@pytest.fixture(scope="session")
def mtp_models(tmp_path_factory) -> dict[str, Path]:
    """The DSA pair with one MTP layer each (target layers identical to ``sparse_models``)."""
    root = tmp_path_factory.mktemp("mtp-models")
    return {
        name: make_model(root / name, TinyModelSpec(seed=seed, sparse=True, mtp_layers=1))
        for name, seed in (("first", 0), ("second", 1))
    }


@pytest.fixture(scope="session")
def mxfp8_models(tmp_path_factory) -> dict[str, Path]:
    """The dense pair again, kv_b_proj stored as MXFP8 (compressed-tensors)."""
    root = tmp_path_factory.mktemp("mxfp8-models")
    return {
        name: make_model(root / name, TinyModelSpec(seed=seed, kv_b_format="mxfp8"))
        for name, seed in (("first", 0), ("second", 1))
    }


@pytest.fixture(scope="session")
def sparse_mxfp8_models(tmp_path_factory) -> dict[str, Path]:
    """The DSA pair again, kv_b_proj stored as MXFP8 (compressed-tensors)."""
    root = tmp_path_factory.mktemp("sparse-mxfp8-models")
    return {
        name: make_model(root / name, TinyModelSpec(seed=seed, sparse=True, kv_b_format="mxfp8"))
        for name, seed in (("first", 0), ("second", 1))
    }


def run_engine_jobs(
    jobs: dict[str, tuple[list[str], dict]],
    out_dir: Path,
    script: str = "engine_job.py",
    timeout_s: int = ENGINE_TIMEOUT_S,
) -> dict[str, dict]:
    """Run ``script ARGS`` (default ``engine_job.py``) per job side by side (each its own
    process, with extra environment); {name: the job's report, plus its log}."""
    procs = {}
    for name, (args, extra_env) in jobs.items():
        log = open(out_dir / f"{name}.log", "w")  # noqa: SIM115 (closed below)
        cmd = [
            sys.executable,
            str(HERE / script),
            *args[:2],
            str(out_dir / f"{name}.json"),
            *args[2:],
        ]
        env = {**os.environ, **extra_env}
        # cwd: a source tree's *.egg-info would shadow the installed entry points
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=out_dir)
        procs[name] = (proc, log)
    reports = {}
    for name, (proc, log) in procs.items():
        try:
            proc.wait(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        text = (out_dir / f"{name}.log").read_text()
        assert proc.returncode == 0, f"engine run {name!r} failed:\n{text[-4000:]}"
        reports[name] = json.loads((out_dir / f"{name}.json").read_text())
        reports[name]["log"] = text
    return reports


# The e2e tiers (``VLLM_MLA_TEST_MATRIX``, scripts/test.sh): ``ci`` (the default) runs what
# CI runs; ``full`` also runs every row of the topology matrix and the engines CI leaves to
# it (``full_tier``: parallel shapes the ci rows already cover in another combination).
TIER = os.environ.get("VLLM_MLA_TEST_MATRIX", "ci")
if TIER not in ("ci", "full"):
    raise ValueError(f"VLLM_MLA_TEST_MATRIX must be ci or full, got {TIER!r}")
full_tier = pytest.mark.skipif(TIER != "full", reason="full tier: VLLM_MLA_TEST_MATRIX=full")
KV_DTYPES = {"bfloat16": "bf16", "fp8": "fp8_ds_mla"}  # requested -> record format served
# nvfp4_ds_mla records: their own engines (test_nvfp4_engine, the topology's CI row)
NVFP4 = "nvfp4_ds_mla"
RECORDS = {**KV_DTYPES, NVFP4: NVFP4}
# the bfloat16 sparse engines also force safe mode: every bmm of the pair through our op
SPARSE_ENV = {
    "bfloat16": {"VLLM_MLA_SAFE_BMM": "always"},
    "fp8": {"VLLM_MLA_SAFE_BMM": "never"},
    NVFP4: {"VLLM_MLA_SAFE_BMM": "never"},
}
# the seeds' nvfp4 deployment cut to this CPU (TP 4 / DCP 4 / MTP 3 runs in the topology)
NVFP4_DEPLOYMENT = {
    "tensor_parallel_size": 2,
    "decode_context_parallel_size": 2,
    "speculative_config": {"method": "mtp", "num_speculative_tokens": 3},
}


def sparse_jobs(models: dict[str, Path], engine: dict | None = None) -> dict:
    """One B12X_MLA_SPARSE engine job per KV dtype on ``models`` (first, then reload)."""
    args = [str(models["first"]), str(models["second"])]
    extra = ["--engine", json.dumps(engine)] if engine else []
    return {
        kv: ([*args, "--sparse", kv, *extra], {"VLLM_MLA": "1", **SPARSE_ENV[kv]})
        for kv in KV_DTYPES
    }


@pytest.fixture(scope="session")
def sparse_engine(sparse_models, tmp_path_factory) -> dict[str, dict]:
    """{"bfloat16"|"fp8": the tiny DSA model through B12X_MLA_SPARSE, TP 1}."""
    return run_engine_jobs(sparse_jobs(sparse_models), tmp_path_factory.mktemp("sparse-engine"))


def _nvfp4_job(mtp_models, tmp_path_factory, name: str, engine: dict | None) -> dict:
    """The tiny DSA model (one MTP layer) with nvfp4_ds_mla records at ``engine``."""
    args = [str(mtp_models["first"]), str(mtp_models["second"]), "--sparse", NVFP4]
    if engine:
        args += ["--engine", json.dumps(engine)]
    jobs = {name: (args, {"VLLM_MLA": "1", **SPARSE_ENV[NVFP4]})}
    return run_engine_jobs(jobs, tmp_path_factory.mktemp(f"nvfp4-{name}"), timeout_s=600)[name]


@pytest.fixture(scope="session")
def nvfp4_tp1(mtp_models, tmp_path_factory) -> dict:
    """nvfp4_ds_mla records at TP 1, no speculation (the reference of the nvfp4 rows)."""
    return _nvfp4_job(mtp_models, tmp_path_factory, "tp1", None)


@pytest.fixture(scope="session")
def nvfp4_deployment(mtp_models, tmp_path_factory) -> dict:
    """nvfp4_ds_mla records at ``NVFP4_DEPLOYMENT`` (TP 2 / DCP 2 / MTP 3)."""
    return _nvfp4_job(mtp_models, tmp_path_factory, "deployment", NVFP4_DEPLOYMENT)


@pytest.fixture(scope="session")
def engine(models, tmp_path_factory) -> dict[str, dict]:
    """{"off"|"on": the engine job's report}; both engines run side by side."""
    args = [str(models["first"]), str(models["second"])]
    jobs = {name: (args, env) for name, env in RUNS.items()}
    return run_engine_jobs(jobs, tmp_path_factory.mktemp("engine"))


def hf_reference(model_dir: Path, prompt_ids: list[list[int]]) -> list[dict]:
    """transformers fp32: greedy tokens, and log-probabilities of the whole vocabulary at
    every generated position (teacher-forced on its own greedy tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for ids in prompt_ids:
            tokens = list(ids)
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
            full = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)
            generated = tokens[len(ids) :]
            steps = full[len(ids) - 1 : len(tokens) - 1]
            results.append({"token_ids": generated, "logprobs": steps})
    return results


@pytest.fixture(scope="session")
def hf(models, engine) -> dict[str, list[dict]]:
    """The transformers reference for both checkpoints, on the engine's own prompt ids."""
    prompt_ids = [r["prompt_token_ids"] for r in engine["off"]["first"]]
    assert len(prompt_ids) == len(PROMPTS)
    started = time.perf_counter()
    ref = {name: hf_reference(path, prompt_ids) for name, path in models.items()}
    ref["elapsed_s"] = time.perf_counter() - started
    return ref
