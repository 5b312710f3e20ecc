"""A real vLLM engine (CPU build) serving a tiny local MLA model, plugin off and on.

Tolerance: vLLM fp32 vs transformers fp32 log-probabilities within 5e-4 nats. Both
compute the same fp32 arithmetic in different orders (oneDNN GEMMs and SDPA vs
PyTorch eager); measured worst here 3.4e-5 over 3 prompts x 8 steps x top-5. The bugs
this guards against are far larger: vLLM CPU's rotary bug for multi-head MLA queries
moves log-probabilities by more than 0.1. Tokens must match exactly (greedy; the
model's logits are far from uniform, so no near-ties).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vllm_mla.qualify import QualifyConfig, run_qualify

LOGPROB_TOL = 5e-4
LIFECYCLE_ACTIONS = {"materialized", "reloaded", "aliased", "noop"}


def num_layers(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


def assert_matches_reference(got: list[dict], want: list[dict]) -> float:
    """Tokens equal, every reported top-k log-probability within LOGPROB_TOL; worst diff."""
    worst = 0.0
    for i, (ours, ref) in enumerate(zip(got, want, strict=True)):
        assert ours["token_ids"] == ref["token_ids"], f"prompt {i}: greedy tokens differ"
        for step, (top, full) in enumerate(zip(ours["logprobs"], ref["logprobs"], strict=True)):
            for token, logprob in top.items():
                diff = abs(logprob - full[int(token)].item())
                assert diff <= LOGPROB_TOL, f"prompt {i} step {step} token {token}: {diff:.2e}"
                worst = max(worst, diff)
    return worst


@pytest.mark.parametrize("run", ["off", "on"])
@pytest.mark.parametrize("phase", ["first", "reloaded"])
def test_generation_matches_transformers(engine, hf, run, phase):
    reference = hf["first" if phase == "first" else "second"]
    assert_matches_reference(engine[run][phase], reference)


@pytest.mark.parametrize("phase", ["first", "reloaded"])
def test_plugin_on_equals_off_token_for_token(engine, phase):
    on, off = engine["on"][phase], engine["off"][phase]
    assert [r["token_ids"] for r in on] == [r["token_ids"] for r in off]
    for a, b in zip(on, off, strict=True):
        for step_on, step_off in zip(a["logprobs"], b["logprobs"], strict=True):
            assert step_on.keys() == step_off.keys()
            for token, logprob in step_on.items():
                assert abs(logprob - step_off[token]) <= LOGPROB_TOL


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
