"""A real vLLM engine (CPU build) serving a tiny local MLA model, plugin off and on.

Tolerance (``compare.DENSE_LOGPROB_TOL``, its error model stated there): vLLM fp32 vs
transformers fp32 log-probabilities within 5e-4 nats. Both compute the same fp32 arithmetic
in different orders (vLLM CPU's kernels, whichever library it loaded, vs PyTorch eager). The
bugs this guards against are far larger: vLLM CPU's rotary bug for multi-head MLA queries
moves log-probabilities by more than 0.1. Tokens must match exactly: the reference's top-1
is ahead of its top-2 by far more than twice the tolerance at every step (checked below),
so no summation order can swap them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from compare import DENSE_LOGPROB_TOL, assert_dense_match

from vllm_mla.tools.qualify import QualifyConfig, run_qualify

LIFECYCLE_ACTIONS = {"materialized", "reloaded", "aliased", "noop"}


def num_layers(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.parametrize("run", ["off", "on"])
@pytest.mark.parametrize("phase", ["first", "reloaded"])
def test_generation_matches_transformers(engine, hf, run, phase):
    reference = hf["first" if phase == "first" else "second"]
    assert_dense_match(engine[run][phase], reference)


def test_no_greedy_step_is_a_near_tie(hf):
    """The reference's top-1 leads its top-2 by more than 2 x the tolerance everywhere, so
    requiring identical tokens follows from the tolerance's error model."""
    for name in ("first", "second"):
        for ref in hf[name]:
            top2 = torch.topk(ref["logprobs"], 2, dim=-1).values
            assert bool((top2[:, 0] - top2[:, 1] > 2 * DENSE_LOGPROB_TOL).all())


@pytest.mark.parametrize("phase", ["first", "reloaded"])
def test_plugin_on_equals_off_token_for_token(engine, phase):
    on, off = engine["on"][phase], engine["off"][phase]
    assert_dense_match(on, off)
    for a, b in zip(on, off, strict=True):
        assert [set(s) for s in a["logprobs"]] == [set(s) for s in b["logprobs"]]


def test_the_engine_runs_the_cpu_library_its_isa_level_asks_for(engine):
    """vLLM CPU loaded the kernel library the (possibly capped) CPU features ask for, in the
    engine's own process: with VLLM_MLA_CPU_ISA=avx2 that is _C_AVX2 on any x86 host."""
    level = os.environ.get("VLLM_MLA_CPU_ISA", "native").strip().lower() or "native"
    for report in engine.values():
        cpu = report["state_first"]["cpu"]
        assert cpu["isa"] == level
        if cpu["expected_library"] is None:  # not x86: one library
            continue
        assert cpu["loaded_libraries"] == [cpu["expected_library"]]
        if level == "avx2":
            assert cpu["loaded_libraries"] == ["_C_AVX2"] and not cpu["amx"]


def test_plugin_is_off_when_disabled(engine):
    state = engine["off"]["state_first"]
    assert state["plugin"] == {}
    assert state["telemetry"]["post_load"] == [] and state["telemetry"]["query"] == {}
    assert state["telemetry"]["absorbed"] == {} and state["routed"] == ["plain"]
    assert "disabled by VLLM_MLA=0" in engine["off"]["log"]


def test_patches_ran_inside_the_engine(engine, models):
    report = engine["on"]
    state = report["state_first"]
    assert state["telemetry"]["pid"] == report["pid"] != os.getpid()
    assert state["plugin"]["lifecycle"].startswith("applied")
    assert state["plugin"]["query"].startswith("applied")
    # the lifecycle ran once for every MLA layer at load...
    layers = num_layers(models["first"])
    events = state["telemetry"]["post_load"]
    loads = [(name, a) for name, a in events if a != "safe route bound"]
    assert len(loads) == layers and len({name for name, _ in loads}) == layers
    # safe mode is forced: every layer's pair was routed through our op
    assert [a for _, a in events if a == "safe route bound"] == ["safe route bound"] * layers
    assert state["routed"] == ["dense"]
    assert {action for _, action in loads} <= LIFECYCLE_ACTIONS
    # ...fp32 kv_b_proj kept for CPU's dense prefill: the pair aliases it, as upstream's does
    assert state["kv_b_dtype"] == "torch.float32"
    assert {action for _, action in loads} == {"aliased"}
    # ...and once more for every layer on the engine's own reload_weights
    assert len(report["state_reloaded"]["telemetry"]["post_load"]) == 2 * len(events)
    # both absorptions of every decode step of every layer ran our op: the query bmm in
    # forward_impl and the V up-projection (fp32 here, so the op's torch kernel)
    n = (max(len(r["token_ids"]) for r in report["first"]) - 1) * layers
    assert state["telemetry"]["query"] == {"v_up_proj:routed": n}
    assert state["telemetry"]["absorbed"] == {"torch:W_UK_T": n, "torch:W_UV": n}


@pytest.mark.parametrize("run", ["off", "on"])
def test_reload_keeps_absorbed_pair_addresses(engine, run):
    before = engine[run]["state_first"]["pointers"]
    after = engine[run]["state_reloaded"]["pointers"]
    assert before and before == after


def test_live_ledger_equals_qualify_prediction(engine, models):
    live = engine["on"]["state_first"]["ledger"]
    predicted = run_qualify(
        QualifyConfig(model=str(models["first"]), tp=1, dtype="float32", mha_prefill=True)
    )
    assert predicted["layers"] == len(live)
    for owner in ("absorbed", "source", "packed"):
        assert sum(row[owner] for row in live.values()) == predicted["lean"][f"{owner}_bytes"]
    assert predicted["checks"]["parity_ok"] and predicted["reclaimed_bytes"] == 0
