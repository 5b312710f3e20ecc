"""A tiny GLM-5.3-Flash with its real layer pattern, KDA linear attention interleaved with
MLA under mHC hyper-connections, served end to end by vLLM CPU: the KDA layers through
the plugin's torch stand-ins for vLLM's Triton kernels (``cpu_glm5next_kda_*``), mHC
through vLLM's torch mHC with the layer norms vLLM CPU drops put back
(``cpu_glm5next_mhc_*``), the MLA layer through B12X_MLA_SPARSE and the portable kpool
indexer.

The checkpoint (``TinyModelSpec(arch="glm5-next", layers=4, kda=True, mhc=True)``):
layers 0-2 KDA (4 heads of 128, short convolutions of width 4, the bounded gate at -5),
layer 3 MLA with its kpool indexer (GLM-5.3-Flash's rule: every fourth layer MLA), four
residual streams mixed by each layer's hyper-connections, top-k 16 under the 80-token
prompt. Engines in bf16 (vLLM's GLM-5-next code requires it) with bf16 and fp8_ds_mla
records, then ``reload_weights`` with a second checkpoint; TP 2 (marker ``topology``:
two KDA heads a rank).

The reference is transformers' own GLM-5-next in fp32 (its KDA layers, chunked delta rule
and convolutions, its hyper-connections, on the checkpoint's tensors), with the same error
model as the all-MLA checkpoint (``glm5next_match``): perturbed references, the KDA
layers' outputs among the perturbed values.
"""

from __future__ import annotations

import pytest
from compare import compare
from conftest import KV_DTYPES
from dsa_reference import replaced
from engine_job import MAX_TOKENS
from glm5next_match import INDEX_TOPK, bf16_engines, checkpoints, matcher, top5
from glm5next_reference import load, reference

from vllm_mla.tools import tiny_glm5next
from vllm_mla.tools.tinymodel import TinyModelSpec

LAYERS = 4
KDA_LAYERS = 3  # layers 0-2; layer 3 is MLA


def spec(seed: int) -> TinyModelSpec:
    return TinyModelSpec(
        arch="glm5-next", layers=LAYERS, kda=True, mhc=True, index_topk=INDEX_TOPK, seed=seed
    )


@pytest.fixture(scope="session")
def kda_models(tmp_path_factory) -> dict:
    """``first`` and ``second`` (the reload) KDA + MLA + mHC checkpoints."""
    return checkpoints(tmp_path_factory.mktemp("glm5next-kda-models"), spec)


@pytest.fixture(scope="session")
def kda_engine(kda_models, tmp_path_factory) -> dict[str, dict]:
    """{"bfloat16"|"fp8": the bf16 engine on the checkpoints, TP 1}."""
    return bf16_engines(
        kda_models, tmp_path_factory.mktemp("glm5next-kda-engine"), tuple(KV_DTYPES)
    )


@pytest.fixture(scope="session")
def kda_tp2(kda_models, tmp_path_factory) -> dict:
    """The bf16-record engine at TP 2 (one CPU core per rank), first and reloaded."""
    out = tmp_path_factory.mktemp("kda-tp2")
    return bf16_engines(kda_models, out, ("bfloat16",), tensor_parallel_size=2)["bfloat16"]


@pytest.fixture(scope="session")
def prompt_ids(kda_engine) -> list[list[int]]:
    return [r["prompt_token_ids"] for r in kda_engine["bfloat16"]["first"]]


@pytest.fixture(scope="session")
def match(kda_models, prompt_ids):
    """``glm5next_match.matcher`` on the KDA + MLA + mHC checkpoints (the prompts longer than
    top-k are those whose selection decides)."""
    selecting = [i for i, ids in enumerate(prompt_ids) if len(ids) > INDEX_TOPK]
    return matcher(kda_models, prompt_ids, selecting)


def test_the_checkpoint_interleaves_kda_and_mla_under_mhc_as_glm53_flash_does(kda_models):
    """transformers builds KDA layers where the checkpoint says so and hyper-connections
    over four streams, and ``load`` asserts every tensor is used and every parameter
    loaded (the KDA and mHC tensors under transformers' names)."""
    model, _ = load(kda_models["first"])
    config = model.config
    assert config.mhc and config.hc_mult == 4
    assert config.layer_types == ["linear_attention"] * KDA_LAYERS + ["indexed_attention"]
    assert (config.linear_num_heads, config.linear_head_dim) == (
        tiny_glm5next.KDA_HEADS,
        tiny_glm5next.KDA_HEAD_DIM,
    )
    kinds = [type(layer.self_attn).__name__ for layer in model.layers]
    assert kinds == ["Glm5NextTextLinearAttention"] * KDA_LAYERS + ["Glm5NextTextAttention"]


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_greedy_tokens_and_logprobs_match_the_reference(kda_engine, match, kv):
    match(kda_engine[kv]["first"], "first", KV_DTYPES[kv])


def test_the_kda_layers_decide_the_output(kda_models, kda_engine, prompt_ids, match):
    """The comparison sees the KDA layers: the reference with their gates open (no decay,
    ``exp(g) = 1``: a stand-in that drops the gate) fails it."""
    from transformers.models.glm5_next import modeling_glm5_next as m

    def no_decay(self, hidden_states):
        return hidden_states.new_zeros(*hidden_states.shape[:2], self.num_heads, self.head_dim)

    with replaced(m.Glm5NextTextForgetGate, forward=no_decay):
        wrong = reference(kda_models["first"], prompt_ids, MAX_TOKENS, "bf16")
    with pytest.raises(AssertionError, match=r"median|worst|near-tie") as caught:
        match(top5(wrong), "first", "bf16")
    print(f"gates open: {caught.value}")


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_served_by_the_kda_and_mhc_stand_ins_and_our_backend(kda_engine, kv):
    """Every step ran each KDA layer once through a stand-in (prefill or decode), every mHC
    boundary through ours, and the MLA layer through our backend, indexer and writer."""
    for phase in ("first", "reloaded"):
        state = kda_engine[kv][f"state_{phase}"]
        assert state["layers"] == LAYERS - KDA_LAYERS
        assert state["kda_heads"] == [tiny_glm5next.KDA_HEADS] * KDA_LAYERS
        counts = state["telemetry"]["sparse"]
        steps = counts["forward_mqa:reference"]  # one MLA layer: one call a step
        assert counts["indexer:kpool:cpu"] == steps == counts[f"kv_write:{KV_DTYPES[kv]}"]
        # mHC: layer 0's pre once a step, every other block boundary fused, the last post
        assert counts["mhc:pre:cpu"] == counts["mhc:post:cpu"] == steps
        assert counts["mhc:fused_post_pre:cpu"] == (2 * LAYERS - 1) * steps
        prefill, decode = counts["kda:chunk:cpu"], counts["kda:recurrent:cpu"]
        assert counts["kda:gather:cpu"] == prefill == counts["kda:scatter:cpu"]
        assert prefill % KDA_LAYERS == 0 and decode % KDA_LAYERS == 0
        assert decode >= KDA_LAYERS * (MAX_TOKENS - 1)  # each request's decode steps
        assert prefill + decode >= KDA_LAYERS * steps  # a mixed step runs both
    assert "finalize_layerwise_processing" in state["plugin"]["lifecycle"]  # glm5next_reload


def test_reload_serves_the_second_checkpoint(kda_models, kda_engine, prompt_ids, match):
    """The KDA layers' merged convolution weights are refilled (``glm5next_reload``;
    without it the reloaded engine matched neither checkpoint, median 7.1 nats)."""
    report = kda_engine["bfloat16"]
    assert report["state_reloaded"]["pointers"] == report["state_first"]["pointers"]
    match(report["reloaded"], "second", "bf16")
    first = reference(kda_models["first"], prompt_ids, MAX_TOKENS, "bf16")
    assert not compare(report["reloaded"], first).same_tokens


@pytest.mark.topology
@pytest.mark.parametrize("phase", ["first", "reloaded"])
def test_tp2_splits_the_kda_heads_and_matches_the_reference(kda_tp2, match, phase):
    """TP 2: each rank holds 2 of each KDA layer's 4 heads (its convolution channels and
    recurrent states) and 2 of the MLA layer's 4; the generation matches as TP 1's does."""
    match(kda_tp2[phase], "first" if phase == "first" else "second", "bf16")
    states = kda_tp2[f"states_{phase}"]
    assert len({s["telemetry"]["pid"] for s in states}) == 2
    for state in states:
        assert state["kda_heads"] == [tiny_glm5next.KDA_HEADS // 2] * KDA_LAYERS
        assert [shape[0][0] for shape in state["pair_shapes"].values()] == [2]
        decode = state["telemetry"]["sparse"]["kda:recurrent:cpu"]
        assert decode % KDA_LAYERS == 0 and decode >= KDA_LAYERS * (MAX_TOKENS - 1)
