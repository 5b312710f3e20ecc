"""Decode context parallelism end to end: the tiny DSA model at TP 2 / DCP 2 against
TP 2 / DCP 1 on vLLM CPU, through B12X_MLA_SPARSE and the portable indexer.

Per KV cache dtype (``fp8`` -> ``fp8_ds_mla``, ``bfloat16``) two engines run side by side
(engine_job.py, its own process each, two worker processes per engine), the same three
prompts (the second, 80 tokens, longer than the model's top-k of 32, so the indexer
drops tokens), then each reloads a second checkpoint. Under DCP every rank holds half of
every request's KV (interleave 1), its indexer scores its half and the ranks merge their
top-k candidates, its attention attends to the selected tokens it holds and vLLM merges
the ranks by their LSE (``ag_rs``; on vLLM CPU through our torch stand-ins of its two
Triton-only DCP kernels, ``vllm_mla.vllm.sparse.cpu_dcp``).

Tolerance (``compare.SPARSE_LOGPROB_TOL``, its error model stated there): greedy tokens
identical; top-5 log-probabilities within 2e-2 nats of DCP 1's, their median within
2.5e-3. DCP changes only the order of fp32 sums (the per-rank softmax partials, their
merge, the TP/DCP collectives); the selection is the same (exact merge, tie rule
included: tests/test_sparse_dcp.py), so the quantization decisions are the same except
where a value lands within fp32 noise of a rounding boundary (a cached e4m3 / bf16
latent element, an index key), the flips that model bounds.

Control: vLLM CPU's own dense MLA backend refuses DCP at worker start-up (its impl
cannot return the decode LSE).

Tier: the engine pairs run in the full tier (``VLLM_MLA_TEST_MATRIX=full``); CI's topology
rows run DCP 2-4 against TP 1 with both record formats, interleaves and MTP. The control
runs in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from compare import assert_sparse_match
from conftest import ENGINE_TIMEOUT_S, HERE, KV_DTYPES, full_tier, run_engine_jobs
from engine_job import SPARSE_BACKEND

pytestmark = pytest.mark.topology  # once per suite, not per forced ISA
ENGINES = {
    "dcp1": {"tensor_parallel_size": 2},
    "dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
}
PHASES = ("first", "reloaded")


@pytest.fixture(scope="session")
def dcp_engines(sparse_models, tmp_path_factory) -> dict[str, dict[str, dict]]:
    """{kv dtype: {"dcp1"|"dcp2": the engine job's report}}: per dtype both side by side."""
    args = [str(sparse_models["first"]), str(sparse_models["second"])]
    reports = {}
    for kv in KV_DTYPES:
        jobs = {
            name: ([*args, "--sparse", kv, "--engine", json.dumps(engine)], {"VLLM_MLA": "1"})
            for name, engine in ENGINES.items()
        }
        reports[kv] = run_engine_jobs(jobs, tmp_path_factory.mktemp(f"dcp-{kv}"))
    return reports


@full_tier
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_dcp2_generates_what_dcp1_generates(dcp_engines, kv, phase):
    got, want = dcp_engines[kv]["dcp2"][phase], dcp_engines[kv]["dcp1"][phase]
    assert max(len(r["prompt_token_ids"]) for r in want) > 32  # past the top-k
    c = assert_sparse_match(got, want)
    print(f"DCP 2 vs DCP 1, {kv}, {phase}: worst {c.worst:.2e}, median {c.median:.2e}")


@full_tier
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_our_backend_and_indexer_served_every_rank(dcp_engines, kv):
    """Per rank (``states_first``, read in each worker): our backend with the requested
    record format, our DCP indexer path and attention on this rank's shard; DCP 1's
    ranks ran the paths without DCP."""
    for name, events in (("dcp2", ("indexer:cpu:dcp", "forward_mqa:reference:dcp")),):
        report = dcp_engines[kv][name]
        states = report["states_first"]
        assert len(states) == 2 and len({s["telemetry"]["pid"] for s in states}) == 2
        for rank, state in enumerate(states):
            assert state["telemetry"]["pid"] != os.getpid()
            assert state["backend"] == SPARSE_BACKEND
            assert state["kv_format"] == KV_DTYPES[kv]
            sparse = state["telemetry"]["sparse"]
            assert sparse.get(events[0], 0) > 0, sparse
            assert sparse.get(f"{events[1]}{rank}/2", 0) > 0, sparse
            assert "indexer:cpu" not in sparse and "forward_mqa:reference" not in sparse
            assert sparse.get(f"kv_write:{KV_DTYPES[kv]}", 0) > 0
        assert "DCP slot mapping and LSE correction in torch" in report["log"]
    for state in dcp_engines[kv]["dcp1"]["states_first"]:
        sparse = state["telemetry"]["sparse"]
        assert sparse.get("indexer:cpu", 0) > 0 and sparse.get("forward_mqa:reference", 0) > 0
        assert not any("dcp" in event for event in sparse)


def test_vllms_own_dense_cpu_backend_refuses_dcp(models, tmp_path):
    """The control: plugin off, the dense tiny model on vLLM CPU's own CPU_MLA at TP 2 /
    DCP 2 stops at worker start-up with vLLM's own reason."""
    cmd = [
        sys.executable,
        str(HERE / "engine_job.py"),
        str(models["first"]),
        str(models["second"]),
        str(tmp_path / "dense.json"),
        "--engine",
        json.dumps(ENGINES["dcp2"]),
    ]
    env = {**os.environ, "VLLM_MLA": "0"}
    done = subprocess.run(
        cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S
    )
    log = done.stdout + done.stderr
    assert done.returncode != 0
    assert (
        "requires attention implementations to return the softmax LSE during decode, "
        "but CPUMLAImpl does not"
    ) in log, log[-3000:]
