"""Both absorbed-weight modes in a real vLLM CPU engine: direct (MXFP8 views of an MXFP8
kv_b_proj, no BF16 pair) and safe (every bmm of the pair through our op), for the dense
tiny model and the tiny DSA model.

Dense: an MXFP8 compressed-tensors checkpoint (kv_b_proj only), loaded by vLLM's emulation
MXFP8 kernel registered for CPU (``cpu-mxfp8``) with
``VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD=0`` (it keeps e4m3 values and E8M0 scales); the
plugin in direct mode against stock vLLM (plugin off) on the same checkpoint. DSA:
B12X_MLA_SPARSE in direct mode against the same engine in bf16 mode (stock vLLM CPU
cannot serve DSA). Tolerances (error models in ``compare``): the values are the same (MXFP8
is exact in fp32), only fp32 summation order differs, so dense runs are held to
``DENSE_LOGPROB_TOL``; the DSA runs quantize their cache and index keys after that noise,
so a rare decision can flip: ``SPARSE_LOGPROB_TOL``. Telemetry counts show our op served
every absorption of every step of every layer.
"""

from __future__ import annotations

import pytest
from compare import assert_dense_match, assert_sparse_match
from conftest import run_engine_jobs
from engine_job import MAX_TOKENS

PHASES = ("first", "reloaded")
MX_ENV = {"VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD": "0"}


@pytest.fixture(scope="session")
def dense_runs(mxfp8_models, tmp_path_factory) -> dict[str, dict]:
    args = [str(mxfp8_models["first"]), str(mxfp8_models["second"])]
    jobs = {
        "off": ([*args, "--cpu-mxfp8"], {"VLLM_MLA": "0", **MX_ENV}),
        "direct": (args, {"VLLM_MLA": "1", "VLLM_MLA_ABSORBED": "direct", **MX_ENV}),
    }
    return run_engine_jobs(jobs, tmp_path_factory.mktemp("absorbed-dense"))


@pytest.fixture(scope="session")
def sparse_runs(sparse_mxfp8_models, tmp_path_factory) -> dict[str, dict]:
    args = [str(sparse_mxfp8_models["first"]), str(sparse_mxfp8_models["second"])]
    args += ["--sparse", "bfloat16"]
    env = {"VLLM_MLA": "1", **MX_ENV}
    jobs = {
        "bf16": (args, {**env, "VLLM_MLA_ABSORBED": "bf16"}),
        "direct": (args, {**env, "VLLM_MLA_ABSORBED": "direct"}),
    }
    return run_engine_jobs(jobs, tmp_path_factory.mktemp("absorbed-sparse"))


def assert_same_top5(got: list[dict], want: list[dict]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert [set(s) for s in a["logprobs"]] == [set(s) for s in b["logprobs"]], f"prompt {i}"


@pytest.mark.parametrize("phase", PHASES)
def test_dense_direct_generates_what_stock_vllm_generates(dense_runs, phase):
    assert_dense_match(dense_runs["direct"][phase], dense_runs["off"][phase])
    assert_same_top5(dense_runs["direct"][phase], dense_runs["off"][phase])
    assert dense_runs["direct"]["first"] != dense_runs["direct"]["reloaded"]


def _decode_steps(report) -> int:
    return max(len(r["token_ids"]) for r in report["first"]) - 1


def test_dense_direct_serves_every_decode_absorption_from_the_pack(dense_runs):
    report = dense_runs["direct"]
    state = report["state_first"]
    layers = state["layers"]
    assert state["plugin"]["cpu-mxfp8"].startswith("registered EmulationMxfp8LinearKernel")
    assert state["kv_b_dtype"] == "torch.float8_e4m3fn"
    assert state["routed"] == ["mxfp8"]
    assert [a for _, a in state["telemetry"]["post_load"]] == ["direct"] * layers
    n = _decode_steps(report) * layers  # CPU_MLA: prefill is dense MHA, decode absorbs
    assert state["telemetry"]["absorbed"] == {"torch-mxfp8:W_UK_T": n, "torch-mxfp8:W_UV": n}
    reloaded = report["state_reloaded"]["telemetry"]["post_load"]
    assert [a for _, a in reloaded[layers:]] == ["direct-reloaded"] * layers


def test_dense_direct_holds_the_pack_and_no_pair(dense_runs):
    direct = dense_runs["direct"]["state_first"]["ledger"]
    stock = dense_runs["off"]["state_first"]["ledger"]
    for name, row in direct.items():
        assert row["source"] == 0 and row["packed"] == 0
        # stock keeps the same pack as kv_b_proj's source, plus an fp32 pair
        assert row["absorbed"] == stock[name]["source"] > 0
        assert stock[name]["absorbed"] > 3 * row["absorbed"]


@pytest.mark.parametrize("run", ["off", "direct"])
def test_reload_keeps_the_addresses(dense_runs, run):
    before = dense_runs[run]["state_first"]["pointers"]
    assert before and before == dense_runs[run]["state_reloaded"]["pointers"]


@pytest.mark.parametrize("phase", PHASES)
def test_sparse_direct_generates_what_the_bf16_pair_generates(sparse_runs, phase):
    assert_sparse_match(sparse_runs["direct"][phase], sparse_runs["bf16"][phase])


def test_sparse_direct_serves_every_absorption_of_every_step(sparse_runs):
    state = sparse_runs["direct"]["state_first"]
    layers = state["layers"]
    assert state["routed"] == ["mxfp8"]
    # MQA-only: the prefill step absorbs too; one prefill step + MAX_TOKENS - 1 decode
    n = MAX_TOKENS * layers
    assert state["telemetry"]["sparse"]["forward_mqa:reference"] == n
    assert state["telemetry"]["absorbed"] == {"torch-mxfp8:W_UK_T": n, "torch-mxfp8:W_UV": n}
    for phase in ("state_first", "state_reloaded"):
        rows = sparse_runs["direct"][phase]["ledger"].values()
        bf16 = sparse_runs["bf16"][phase]["ledger"].values()
        # direct holds the pack; the bf16 mode released it and holds the (fp32) pair
        assert all(r["source"] == 0 and r["packed"] == 0 for r in rows)
        assert sum(r["absorbed"] for r in rows) * 3 < sum(r["absorbed"] for r in bf16)
    direct = sparse_runs["direct"]
    assert direct["state_first"]["pointers"] == direct["state_reloaded"]["pointers"]
