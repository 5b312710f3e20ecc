"""The fused query projection in a real vLLM CPU engine: the tiny dense model on CPU_MLA,
``VLLM_MLA_QUERY=fused`` against ``staged`` (each its own engine process, side by side).

What runs where: CPU_MLA's ``forward_mqa`` is wrapped (``vllm_mla.vllm.fused_query``),
W_UK_T's bmm in ``MLAAttention.forward_impl`` is deferred, and the wrapper hands CPU_MLA
one ``[M, H, 576]`` query written by the projection's torch path (the fp32 engine is
outside the Triton kernel's gate): per decode layer-step one projection and no separate
bmm or concat, where staged runs vLLM's bmm, then CPU_MLA's ``torch.cat``.

Tolerance: none. The torch path runs the same bmm (same operands, same library call,
same fp32 sums) into the query's left part and copies q_pe beside it, so every query
element equals staged's bit for bit (``tests_vllm/test_fused_query.py`` proves it on
vLLM's own impls); tokens and log-probabilities must be identical.
"""

from __future__ import annotations

import pytest
from conftest import run_engine_jobs
from engine_job import MAX_TOKENS

MODES = ("fused", "staged")


@pytest.fixture(scope="module")
def query_engines(models, tmp_path_factory) -> dict[str, dict]:
    args = [str(models["first"]), str(models["second"])]
    jobs = {mode: (args, {"VLLM_MLA": "1", "VLLM_MLA_QUERY": mode}) for mode in MODES}
    return run_engine_jobs(jobs, tmp_path_factory.mktemp("fused-query"))


@pytest.mark.parametrize("phase", ["first", "reloaded"])
def test_fused_generates_exactly_what_staged_generates(query_engines, phase):
    got, want = query_engines["fused"][phase], query_engines["staged"][phase]
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    assert [r["logprobs"] for r in got] == [r["logprobs"] for r in want]


@pytest.mark.parametrize("phase", ["first", "reloaded"])
def test_one_projection_per_decode_layer_step(query_engines, phase):
    """Decode layer-steps are counted independently by the V up-projection patch
    (``v_up_proj:*``, once per layer per decode step): one prompt batch of three, all
    prefilled in the first step, so ``MAX_TOKENS - 1`` decode steps per generate (two
    generates by ``reloaded``)."""
    report = query_engines["fused"]
    state = report[f"state_{phase}"]
    assert all(len(r["token_ids"]) == MAX_TOKENS for r in report[phase])
    runs = 1 if phase == "first" else 2
    layer_steps = state["layers"] * (MAX_TOKENS - 1) * runs
    telemetry = state["telemetry"]
    v_up = sum(n for event, n in telemetry["query"].items() if event.startswith("v_up_proj:"))
    assert v_up == layer_steps
    assert telemetry["fused_query"] == {"forward_mqa:torch": layer_steps}  # nothing flushed
    assert telemetry["absorbed"] == {}  # no W_UK_T bmm ran on its own: each was deferred
    # bound at load and again at the reload, every layer
    assert telemetry["query"]["bind:forward_mqa:torch"] == state["layers"] * runs
    assert state["backend"] == "CPU_MLA"


def test_staged_engine_leaves_vllms_query_path_alone(query_engines):
    for phase in ("first", "reloaded"):
        telemetry = query_engines["staged"][f"state_{phase}"]["telemetry"]
        assert telemetry["fused_query"] == {}
        assert not any(event.startswith("bind:") for event in telemetry["query"])
