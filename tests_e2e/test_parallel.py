"""The configurations these models are served in: tensor parallel and speculative decoding
(MTP, ngram) through the plugin, in multi-process vLLM CPU engines.

- TP 2 (``distributed_executor_backend="mp"``, one CPU core per rank): the dense tiny model
  on CPU_MLA and the tiny DSA model on B12X_MLA_SPARSE with both cache formats, each
  against the same engine at TP 1: greedy tokens identical, log-probabilities within the
  stated tolerances (``compare``: a TP all-reduce sums partial products in another order,
  the error model's continuous part, and for DSA the decisions that order can flip); every
  rank holds half the heads of every pair and served every step through our backend and
  indexer; a reload at TP 2 keeps every rank's pair in place.
- MTP (``speculative_config={"method": "mtp", "num_speculative_tokens": k}``) on a DSA
  checkpoint carrying one MTP layer (its target layers are the TP 1 model's, drawn from
  the same seed), k = 1 at TP 1 (next_n 2: vLLM's native decode layout, [B, 2] contexts)
  and k = 3 at TP 2 (flattened per token through vLLM's builder and our torch stand-in for
  its Triton kernel): greedy tokens identical to the engine without speculation; the draft
  layer's kv_b_proj released and its pair built on every rank; the acceptance rate
  reported (the MTP layer has random weights: it proposes what the target would not say,
  so every draft is rejected and every step verifies k + 1 tokens per request).
- ngram speculation (k = 3) on a DSA checkpoint whose output repeats itself (init_std
  0.05), at TP 1 and at TP 2 / DCP 2: drafts accepted (a different number per request and
  step: ragged verify batches), so accepted draft tokens' KV and index keys serve later
  steps; tokens and log-probabilities equal to the same engine at TP 1 without speculation.

Marker ``topology``: these run once per suite (``scripts/test.sh`` leaves them out of its
forced-ISA pass: what they test does not depend on the CPU's kernels).
"""

from __future__ import annotations

import json

import pytest
from compare import assert_dense_match, assert_sparse_match
from conftest import KV_DTYPES, RUNS, run_engine_jobs, sparse_jobs
from engine_job import MAX_TOKENS

from vllm_mla.tools.tinymodel import TinyModelSpec, make_model

pytestmark = pytest.mark.topology
TP2 = {"tensor_parallel_size": 2}
PHASES = ("first", "reloaded")
HEADS = 4  # the tiny models' attention heads
MTP = {"method": "mtp"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
NGRAM_TOKENS = 32  # long enough for the repetitive model to repeat itself


@pytest.fixture(scope="session")
def tp2(models, sparse_models, tmp_path_factory) -> dict[str, dict]:
    """{"dense" | "bfloat16" | "fp8": the TP 2 engine}, side by side."""
    args = [str(models["first"]), str(models["second"]), "--engine", json.dumps(TP2)]
    jobs = {"dense": (args, RUNS["on"]), **sparse_jobs(sparse_models, TP2)}
    return run_engine_jobs(jobs, tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="session")
def mtp(mtp_models, tmp_path_factory) -> dict[str, dict]:
    """{"k1": MTP 1 at TP 1, "k3_tp2": MTP 3 at TP 2}, fp8 cache."""
    runs = {
        "k1": {"speculative_config": {**MTP, "num_speculative_tokens": 1}},
        "k3_tp2": {**TP2, "speculative_config": {**MTP, "num_speculative_tokens": 3}},
    }
    jobs = {name: (sparse_jobs(mtp_models, engine)["fp8"]) for name, engine in runs.items()}
    return run_engine_jobs(jobs, tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="session")
def ngram(tmp_path_factory) -> dict[str, dict]:
    """{"plain" | "ngram": the repetitive DSA model, 32 tokens, fp8 cache}."""
    root = tmp_path_factory.mktemp("ngram-models")
    models = {
        name: make_model(root / name, TinyModelSpec(seed=seed, sparse=True, init_std=0.05))
        for name, seed in (("first", 0), ("second", 1))
    }
    tokens = ["--max-tokens", str(NGRAM_TOKENS)]
    runs = {
        "plain": {},
        "ngram": {"speculative_config": NGRAM},
        # ragged acceptance under DCP: each rank's indexer and attention per drafted token
        "ngram_dcp2": {**TP2, "decode_context_parallel_size": 2, "speculative_config": NGRAM},
    }
    jobs = {}
    for name, engine in runs.items():
        args, env = sparse_jobs(models, engine or None)["fp8"]
        jobs[name] = ([*args, *tokens], env)
    return run_engine_jobs(jobs, tmp_path_factory.mktemp("ngram"))


def ranks(report: dict, phase: str = "first") -> list[dict]:
    return report[f"states_{phase}"]


# -- tensor parallel ----------------------------------------------------------------------
@pytest.mark.parametrize("phase", PHASES)
def test_tp2_dense_generates_what_tp1_generates(tp2, engine, phase):
    assert_dense_match(tp2["dense"][phase], engine["on"][phase])


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_tp2_dsa_generates_what_tp1_generates(tp2, sparse_engine, kv, phase):
    assert_sparse_match(tp2[kv][phase], sparse_engine[kv][phase])


@pytest.mark.parametrize("name", ["dense", *KV_DTYPES])
def test_every_rank_holds_half_the_heads_and_ran_the_plugin(tp2, name):
    report = tp2[name]
    for phase in PHASES:
        states = ranks(report, phase)
        assert len(states) == 2 and len({s["telemetry"]["pid"] for s in states}) == 2
        for state in states:
            layers = state["layers"]
            shapes = list(state["pair_shapes"].values())
            assert len(shapes) == layers
            assert all(uk[0] == uv[0] == HEADS // 2 for uk, uv in shapes)
            actions = [a for _, a in state["telemetry"]["post_load"] if a != "safe route bound"]
            # a dense source kept in the activation dtype is aliased (as upstream does)
            assert set(actions[:layers]) <= {"materialized", "aliased"}
            assert len(actions) == layers * (2 if phase == "reloaded" else 1)
            assert set(actions[layers:]) <= {"reloaded", "aliased"}
    # a reload keeps every rank's pair where it was, and serves the second checkpoint
    for first, again in zip(ranks(report), ranks(report, "reloaded"), strict=True):
        assert first["pointers"] == again["pointers"]
    assert report["first"] != report["reloaded"]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_every_rank_served_every_step_through_our_backend_and_indexer(tp2, kv):
    for state in ranks(tp2[kv]):
        counts = state["telemetry"]["sparse"]
        steps = MAX_TOKENS * state["layers"]  # one prefill + MAX_TOKENS - 1 decodes
        assert counts["forward_mqa:reference"] == steps
        assert counts["indexer:cpu"] == steps
        assert counts[f"kv_write:{KV_DTYPES[kv]}"] == steps
        ledger = state["ledger"]
        assert all(row["source"] == 0 and row["packed"] == 0 for row in ledger.values())


# -- MTP ----------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("run", ["k1", "k3_tp2"])
def test_mtp_generates_what_the_engine_without_speculation_generates(
    mtp, sparse_engine, run, phase
):
    assert_sparse_match(mtp[run][phase], sparse_engine["fp8"][phase])


@pytest.mark.parametrize(("run", "k", "tp"), [("k1", 1, 1), ("k3_tp2", 3, 2)])
def test_mtp_drafts_and_verifies_through_our_backend_on_every_rank(mtp, run, k, tp):
    report = mtp[run]
    counters = report["spec_decode_first"]
    print(f"MTP k={k} TP {tp}: {counters}")
    # every decode step after the first proposes k tokens per request (3 requests); none is
    # accepted from the random MTP layer, so the run takes MAX_TOKENS - 1 verify steps
    assert counters["num_draft_tokens"] == k * counters["num_drafts"] > 0
    assert counters["num_accepted_tokens"] == 0
    assert counters["num_drafts"] == 3 * (MAX_TOKENS - 1)
    assert len(ranks(report)) == tp
    for state, draft in zip(ranks(report), report["drafts_first"], strict=True):
        layers = state["layers"]
        # the target's layers every step, the MTP layer k times per step (once per draft)
        assert state["telemetry"]["sparse"]["forward_mqa:reference"] == (
            MAX_TOKENS * layers + k * MAX_TOKENS
        )
        events = state["telemetry"]["post_load"]
        (mtp_layer,) = draft["pair_shapes"]
        assert [a for name, a in events if "mtp_block" in name or ".2." in name] == ["materialized"]
        ((uk, uv),) = draft["pair_shapes"].values()
        assert uk[0] == uv[0] == HEADS // tp
        assert draft["ledger"][mtp_layer]["source"] == 0  # the draft's kv_b_proj released
        assert draft["ledger"][mtp_layer]["absorbed"] > 0
    for draft, again in zip(report["drafts_first"], report["drafts_reloaded"], strict=True):
        assert draft["pointers"] == again["pointers"]  # reload: the draft's pair in place


# -- ngram --------------------------------------------------------------------------------
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("run", ["ngram", "ngram_dcp2"])
def test_ngram_accepts_drafts_and_generates_what_the_engine_without_it_generates(ngram, run, phase):
    assert_sparse_match(ngram[run][phase], ngram["plain"][phase])
    counters = ngram[run]["spec_decode_first"]
    print(f"{run} k=3: {counters}")
    assert counters["num_accepted_tokens"] > 0
    if run == "ngram_dcp2":  # every rank scored and attended its shard, per drafted token
        for rank, state in enumerate(ranks(ngram[run])):
            sparse = state["telemetry"]["sparse"]
            assert sparse["indexer:cpu:dcp"] > 0 and sparse[f"forward_mqa:reference:dcp{rank}/2"]
