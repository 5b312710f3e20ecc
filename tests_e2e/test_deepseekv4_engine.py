"""A tiny DeepSeek-V4 (``make-model --arch deepseek-v4``) served end to end by vLLM CPU's own
V4 path, which vLLM CPU as released cannot run a step of.

The checkpoint: 4 layers (window-only, C4 with the indexer, C128, C4), 2 heads of 512, a
32-token window, the sink, mHC over 4 streams, 64 experts (6 a token; layer 0 hash-routed),
``index_topk`` 512 (the only top-k vLLM CPU's V4 indexer serves), bf16. The engine job
(``dsv4_job.py``) serves a 150-token prompt alone, then a 2100-token one (525 compressed
entries: the indexer selects) and the short one in one batch.

What is checked, and against what:

- **The plugin is what makes it run**: without it the first step stops in a V4 metadata
  builder's Triton launch (vLLM CPU has no Triton backend); with it the builders run
  through our stand-ins (the sliding-window indices counted by telemetry, the other
  kernels checked against vLLM's own in ``tests_vllm/test_dsv4_cpu.py``).
- **Each request's metadata is its own**: the short prompt's tokens and top-5
  log-probabilities are the same alone and batched behind the long prompt (a token mapped
  to the wrong request, or a window or compressed slot taken from the other request,
  changes them). Error model: both runs compute the short request's rows with the same
  kernels on the same values, except that its GEMMs run inside a larger batch; a GEMM
  blocked otherwise for that batch rounds an output once more or less (one bf16 step,
  2**-8 relative), which over four layers moves a log-probability by well under
  ``BATCH_LOGPROB_TOL``; measured here: identical.
- **Where vLLM's V4 kernels are absent** (``_C_AVX2``, forced by ``VLLM_MLA_CPU_ISA=avx2``)
  the model stops at construction with the library and the cap named.

Not checked here yet: the tokens against transformers' DeepSeek-V4 (a reference that
rounds as vLLM's bf16 activations and fp8 cache records do is the next stage).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mla.tools.tinymodel import TinyModelSpec, make_model
from vllm_mla.vllm import cpu_host

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from dsv4_job import LONG, MAX_TOKENS, SHORT  # noqa: E402

SPEC = TinyModelSpec(
    arch="deepseek-v4",
    heads=2,
    hidden=64,
    vocab=320,
    window=32,
    index_topk=512,
    max_position=4096,
)
BATCH_LOGPROB_TOL = 2e-2  # nats; the error model is in the module docstring
JOB_TIMEOUT_S = 600
has_v4_kernels = cpu_host.expected_library() == "_C"
needs_v4_kernels = pytest.mark.skipif(
    not has_v4_kernels, reason="vLLM CPU loads no _C here: its V4 kernels are absent"
)


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("dsv4") / "tiny", SPEC)


def run_job(model: Path, out_dir: Path, name: str, **env: str) -> tuple[int, str, dict | None]:
    """``dsv4_job.py`` in a process of its own: (exit status, log, report or None)."""
    out = out_dir / f"{name}.json"
    result = subprocess.run(
        [sys.executable, str(HERE / "dsv4_job.py"), str(model), str(out)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        cwd=out_dir,
    )
    log = result.stdout + result.stderr
    return result.returncode, log, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="module")
def served(v4_model, tmp_path_factory) -> dict:
    code, log, report = run_job(v4_model, tmp_path_factory.mktemp("dsv4-on"), "on")
    assert code == 0, log[-4000:]
    return report


@needs_v4_kernels
def test_vllm_cpu_alone_stops_at_the_first_v4_step(v4_model, tmp_path):
    """vLLM CPU as released (plugin off): the V4 metadata builders launch Triton kernels
    on a platform without Triton. The day this passes through, the stand-ins can go."""
    code, log, _ = run_job(v4_model, tmp_path, "off", VLLM_MLA="0")
    assert code != 0
    assert "'function' object is not subscriptable" in log, log[-3000:]


@needs_v4_kernels
def test_the_plugin_serves_every_request(served):
    assert [len(r["token_ids"]) for r in served["batched"]] == [MAX_TOKENS, MAX_TOKENS]
    assert SPEC.index_topk < LONG // 4  # the long prompt's indexer selects
    assert SHORT < LONG
    assert served["telemetry"]["sparse"].get("dsv4:swa-indices:cpu", 0) > 0


@needs_v4_kernels
def test_a_request_is_served_the_same_alone_and_batched(served):
    alone, batched = served["alone"][0], served["batched"][1]
    assert alone["token_ids"] == batched["token_ids"]
    worst = max(
        abs(a[t] - b[t])
        for a, b in zip(alone["logprobs"], batched["logprobs"], strict=True)
        for t in a.keys() & b.keys()
    )
    print(f"short prompt alone vs batched: worst top-5 log-prob difference {worst:.2e}")
    assert worst <= BATCH_LOGPROB_TOL


def test_without_vllms_v4_kernels_the_model_stops_at_construction(v4_model, tmp_path):
    code, log, _ = run_job(v4_model, tmp_path, "avx2", VLLM_MLA_CPU_ISA="avx2")
    assert code != 0
    assert "DeepSeek-V4 is not served on this host" in log, log[-3000:]
    assert "_C_AVX2 (VLLM_MLA_CPU_ISA=avx2)" in log
