"""A tiny DeepSeek-V3.2 (DSA) model served end to end by vLLM CPU through B12X_MLA_SPARSE.

Two engines (KV cache ``bfloat16`` records and ``fp8`` -> ``fp8_ds_mla``), plugin on, fp32,
three prompts in one batch, the second (80 tokens) longer than the model's top-k (32) so
the indexer drops tokens; each then reloads a second checkpoint with the engine's own
``reload_weights``. The reference is transformers' DeepseekV32 emulating vLLM's indexer
quantization and KV-cache rounding (``dsa_reference``).

Tolerance (``compare.SPARSE_LOGPROB_TOL``, its error model stated there): greedy tokens
identical; top-5 log-probabilities within 2e-2 nats of the reference, their median within
2.5e-3. Both sides are fp32 and make the same quantization decisions except where a value
lands within fp32 noise of a rounding boundary, which another CPU's kernels (AVX2, AVX-512,
AMX) can flip. The faults this guards against are far larger: without the emulation (plain
fp32 transformers) the first divergent token already differs by ~1 nat, and tokens change.
"""

from __future__ import annotations

import json
import os

import pytest
from compare import SPARSE_LOGPROB_TOL, assert_sparse_match, compare
from conftest import KV_DTYPES
from dsa_reference import reference
from engine_job import MAX_TOKENS, SPARSE_BACKEND, SPARSE_PROMPTS

PHASES = {"first": "first", "reloaded": "second"}


@pytest.fixture(scope="session")
def sparse_reference(sparse_models, sparse_engine) -> dict:
    """{(kv dtype, phase): the emulating reference}, plus the plain one for the first run."""
    ids = [r["prompt_token_ids"] for r in sparse_engine["bfloat16"]["first"]]
    out = {}
    for kv, fmt in KV_DTYPES.items():
        for phase, model in PHASES.items():
            out[kv, phase] = reference(sparse_models[model], ids, MAX_TOKENS, fmt)
    out["plain"] = reference(sparse_models["first"], ids, MAX_TOKENS, None)
    return out


def test_a_prompt_is_longer_than_top_k(sparse_models, sparse_engine):
    config = json.loads((sparse_models["first"] / "config.json").read_text())
    lengths = [len(r["prompt_token_ids"]) for r in sparse_engine["bfloat16"]["first"]]
    assert len(lengths) == len(SPARSE_PROMPTS) == 3
    assert max(lengths) > config["index_topk"] > min(lengths)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("kv", KV_DTYPES)
def test_greedy_tokens_and_logprobs_match_the_emulating_reference(
    sparse_engine, sparse_reference, kv, phase
):
    assert_sparse_match(sparse_engine[kv][phase], sparse_reference[kv, phase])


def test_the_emulation_is_what_makes_them_match(sparse_engine, sparse_reference):
    """Plain fp32 transformers (no indexer quantization, no KV rounding) does diverge."""
    c = compare(sparse_engine["bfloat16"]["first"], sparse_reference["plain"])
    assert not c.same_tokens or c.worst > 20 * SPARSE_LOGPROB_TOL


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_served_by_our_backend_our_indexer_and_our_cache_writer(sparse_engine, kv):
    report = sparse_engine[kv]
    state = report["state_first"]
    assert state["telemetry"]["pid"] == report["pid"] != os.getpid()
    assert state["backend"] == SPARSE_BACKEND
    assert state["kv_format"] == KV_DTYPES[kv]
    assert state["kv_cache_dtype"] == ("torch.bfloat16" if kv == "bfloat16" else "torch.uint8")
    assert state["plugin"]["sparse-cpu"].startswith("applied")
    counts = state["telemetry"]["sparse"]
    layers = state["layers"]
    # one prefill step and MAX_TOKENS - 1 decode steps, every layer
    steps = MAX_TOKENS
    assert counts["forward_mqa:reference"] == steps * layers
    assert counts[f"kv_write:{KV_DTYPES[kv]}"] == steps * layers
    assert counts["indexer:cpu"] == steps * layers
    # safe mode forced on the bfloat16 engine: both absorptions of every step (prefill
    # too: MQA-only) ran our op (fp32 here, so its torch kernel); off on the fp8 engine
    absorbed = state["telemetry"]["absorbed"]
    if kv == "bfloat16":
        assert absorbed == {"torch:W_UK_T": steps * layers, "torch:W_UV": steps * layers}
        assert state["routed"] == ["dense"]
    else:
        assert absorbed == {} and state["routed"] == ["plain"]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_kv_b_proj_released_and_reload_keeps_the_pair(sparse_engine, kv):
    report = sparse_engine[kv]
    for phase in ("state_first", "state_reloaded"):
        ledger = report[phase]["ledger"]
        assert ledger and all(row["source"] == 0 and row["packed"] == 0 for row in ledger.values())
        assert all(row["absorbed"] > 0 for row in ledger.values())
    assert report["state_first"]["pointers"] == report["state_reloaded"]["pointers"]
    events = report["state_reloaded"]["telemetry"]["post_load"]
    actions = [a for _, a in events if a != "safe route bound"]
    layers = report["state_first"]["layers"]
    assert actions[:layers] == ["materialized"] * layers
    assert actions[layers:] == ["reloaded"] * layers
    assert report["first"] != report["reloaded"]  # the second checkpoint really serves


def test_transformers_loads_the_dsa_checkpoint_with_no_missing_keys(sparse_models):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        sparse_models["first"], dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "DeepseekV32ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
