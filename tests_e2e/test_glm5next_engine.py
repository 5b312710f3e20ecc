"""A tiny GLM-5.3-Flash (``Glm5NextForCausalLM``: MLA of latent 512 without RoPE, the kpool
indexer) served end to end by vLLM CPU through B12X_MLA_SPARSE, the plugin's portable kpool
indexer and its torch stand-ins for the Triton kernels GLM-5.3-Flash's path launches.

The checkpoint (``make_model(..., TinyModelSpec(arch="glm5-next", ...))``): 2 layers, both
MLA (vLLM CPU has no path for GLM-5.3-Flash's KDA layers), 4 heads of qk_nope 256 / v 256,
rope 0, a kpool indexer per layer (32 heads, pools of 16, the tail pool always selected),
dense MLPs, no mHC (vLLM CPU's mHC ops drop the layer's input RMSNorm:
``tiny_glm5next``). ``index_topk`` (128) is at least every context the test reaches, so
every pool and the tail are selected whatever the fp8 scores: the comparison does not
depend on the indexer's near-ties (``tests_vllm/test_kpool_indexer_*`` test its selection).
The engine serves it in bf16, as vLLM's GLM-5-next code requires; KV cache ``bfloat16``
(512-wide records) and ``fp8`` (``fp8_ds_mla``, 656-byte records with an empty RoPE slot);
three prompts in one batch, then ``reload_weights`` with a second checkpoint; and the
bf16-record engine again at TP 2 (marker ``topology``).

The reference (``glm5next_reference``) is transformers' own GLM-5-next layers in fp32 with
vLLM's non-mHC residual and the latent rounded through the cache records.
"""

from __future__ import annotations

import os

import pytest
from compare import compare
from conftest import KV_DTYPES, run_engine_jobs, sparse_jobs
from engine_job import MAX_TOKENS, SPARSE_BACKEND, SPARSE_PROMPTS
from glm5next_reference import load, reference

from vllm_mla.tools.tinymodel import TinyModelSpec, make_model

LAYERS = 2
INDEX_TOPK = 128

# bf16 records. The engine computes in bf16 (every activation, the residual stream
# included, rounds to 8 significant bits: relative 2^-8 at worst) where the reference
# computes in fp32 on the same (bf16-valued) weights. About ten roundings per layer reach
# a logit; with |logit| up to ~10 here their effect on a log-probability is a few 1e-2
# nats (measured on the development host: median 3.2e-2, worst 0.19 at a near-tie).
# Bounds: 3x the median, and a worst entry of 0.5.
BF16_MEDIAN_TOL = 0.1
BF16_LOGPROB_TOL = 0.5
# fp8_ds_mla records. e4m3 keeps 3 significant bits: its rounding step is 2^-4..2^-3 of
# a value, so every latent element within the engine's bf16 noise (2^-8) of a rounding
# midpoint lands on the other neighbour on one side: a few percent of the 512 elements of
# every cached token, not the rare flip of the fp32 engines. What such flips do is measured
# in the test: the reference again with its latent perturbed by bf16-sized noise before
# the rounding (``latent_noise``, FP8_NOISE_SEEDS). The engine's median must lie within
# FP8_NOISE_FACTOR of the largest such median (development host: 0.106 and 0.114, engine
# 0.136), its worst entry within FP8_LOGPROB_TOL (seen: 0.85 perturbed, 1.13 engine).
FP8_NOISE_SEEDS = (1, 2)
FP8_NOISE_FACTOR = 2.0
FP8_LOGPROB_TOL = 2.0
# Greedy tokens may part only at a near-tie: where the reference's log-probabilities of its
# own token and the engine's differ by less than two worst-case errors (each side moved
# by at most the worst bound). From there on the two see different text and are not
# compared; every divergence is printed.
WORST = {"bfloat16": BF16_LOGPROB_TOL, "fp8": FP8_LOGPROB_TOL}


def spec(seed: int) -> TinyModelSpec:
    return TinyModelSpec(arch="glm5-next", layers=LAYERS, index_topk=INDEX_TOPK, seed=seed)


@pytest.fixture(scope="session")
def glm5_models(tmp_path_factory) -> dict:
    """``first`` (seed 0) and ``second`` (seed 1, the reload) tiny GLM-5.3-Flash folders."""
    root = tmp_path_factory.mktemp("glm5next-models")
    return {
        name: make_model(root / name, spec(seed)) for name, seed in (("first", 0), ("second", 1))
    }


@pytest.fixture(scope="session")
def glm5_engine(glm5_models, tmp_path_factory) -> dict[str, dict]:
    """{"bfloat16"|"fp8": the tiny GLM-5.3-Flash through B12X_MLA_SPARSE, TP 1, bf16}."""
    jobs = sparse_jobs(glm5_models, engine={"dtype": "bfloat16"})
    return run_engine_jobs(jobs, tmp_path_factory.mktemp("glm5next-engine"))


@pytest.fixture(scope="session")
def glm5_tp2(glm5_models, tmp_path_factory) -> dict:
    """The bf16-record engine at TP 2 (one CPU core per rank), first and reloaded."""
    jobs = sparse_jobs(glm5_models, engine={"dtype": "bfloat16", "tensor_parallel_size": 2})
    return run_engine_jobs({"tp2": jobs["bfloat16"]}, tmp_path_factory.mktemp("glm5-tp2"))["tp2"]


@pytest.fixture(scope="session")
def prompt_ids(glm5_engine) -> list[list[int]]:
    return [r["prompt_token_ids"] for r in glm5_engine["bfloat16"]["first"]]


def near_tie_divergences(got: list[dict], want: list[dict], worst: float) -> list[str]:
    """Where ``got``'s greedy tokens part from ``want``'s (the reference's full
    log-probabilities); fails unless each is a near-tie of the reference."""
    seen = []
    for i, (ours, ref) in enumerate(zip(got, want, strict=True)):
        for step, (a, b) in enumerate(zip(ours["token_ids"], ref["token_ids"], strict=True)):
            if a == b:
                continue
            margin = float(ref["logprobs"][step][b] - ref["logprobs"][step][a])
            assert margin <= 2 * worst, (
                f"prompt {i} step {step}: engine {a}, reference {b} by {margin:.3f} nats "
                f"(> {2 * worst}: not a near-tie)"
            )
            seen.append(f"prompt {i} step {step}: {a} vs {b}, margin {margin:.3f}")
            break
    return seen


def top5(generation: list[dict]) -> list[dict]:
    """A reference generation as an engine reports it (top-5 per step)."""
    return [
        {
            "token_ids": g["token_ids"],
            "logprobs": [
                {str(int(t)): float(v) for v, t in zip(*lp.topk(5), strict=True)}
                for lp in g["logprobs"]
            ],
        }
        for g in generation
    ]


def assert_match(got: list[dict], want: list[dict], kv: str, median_tol: float) -> None:
    ties = near_tie_divergences(got, want, WORST[kv])
    c = compare(got, want)
    assert c.worst <= WORST[kv], f"{c.worst_at}: {c.worst:.3f} > {WORST[kv]}"
    assert c.median <= median_tol, f"median {c.median:.3f} > {median_tol:.3f}"
    print(f"{kv}: worst {c.worst:.3f} at {c.worst_at}, median {c.median:.4f}; near-ties: {ties}")


def test_transformers_builds_the_checkpoint_and_every_tensor_loads(glm5_models):
    """``load`` asserts every checkpoint tensor is used; the text config is what vLLM
    serves (latent 512, no RoPE, kpool 16 with the tail, all MLA, no mHC)."""
    model, _ = load(glm5_models["first"])
    config = model.config
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim) == (512, 0, 256)
    assert config.index_kpool == 16 and config.index_kpool_always_select_tail
    assert set(config.layer_types) == {"indexed_attention"} and not config.mhc
    assert all(layer.self_attn.indexer is not None for layer in model.layers)


def test_every_context_fits_in_top_k(prompt_ids):
    """The premise that keeps the indexer's near-ties out of the comparison."""
    lengths = [len(ids) for ids in prompt_ids]
    assert len(lengths) == len(SPARSE_PROMPTS)
    assert max(lengths) + MAX_TOKENS <= INDEX_TOPK
    assert max(lengths) > 4 * 16  # still several complete pools and a tail


def test_greedy_tokens_and_logprobs_match_the_reference_bf16_records(
    glm5_models, glm5_engine, prompt_ids
):
    want = reference(glm5_models["first"], prompt_ids, MAX_TOKENS, "bf16")
    assert_match(glm5_engine["bfloat16"]["first"], want, "bfloat16", BF16_MEDIAN_TOL)


def test_greedy_tokens_and_logprobs_match_the_reference_fp8_records(
    glm5_models, glm5_engine, prompt_ids
):
    first = glm5_models["first"]
    want = reference(first, prompt_ids, MAX_TOKENS, "fp8_ds_mla")
    noise = [
        compare(
            top5(reference(first, prompt_ids, MAX_TOKENS, "fp8_ds_mla", latent_noise=seed)), want
        )
        for seed in FP8_NOISE_SEEDS
    ]
    print(
        "perturbed references: "
        + ", ".join(f"median {c.median:.4f} worst {c.worst:.3f}" for c in noise)
    )
    bound = FP8_NOISE_FACTOR * max(c.median for c in noise)
    assert_match(glm5_engine["fp8"]["first"], want, "fp8", bound)


def test_the_tail_pool_is_attended(glm5_models, glm5_engine, prompt_ids):
    """The same reference without the tail pool (``index_kpool_always_select_tail`` off)
    is another model: the engine's match above needs the tail on both sides."""
    no_tail = reference(glm5_models["first"], prompt_ids, MAX_TOKENS, "bf16", tail="dropped")
    c = compare(glm5_engine["bfloat16"]["first"], no_tail)
    assert not c.same_tokens and c.median > 10 * BF16_MEDIAN_TOL, c.median


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_served_by_our_backend_kpool_indexer_and_cache_writer(glm5_engine, kv):
    report = glm5_engine[kv]
    state = report["state_first"]
    assert state["telemetry"]["pid"] == report["pid"] != os.getpid()
    assert state["backend"] == SPARSE_BACKEND
    assert state["kv_format"] == KV_DTYPES[kv]
    assert state["layers"] == LAYERS
    assert [shape[0][1:] for shape in state["pair_shapes"].values()] == [[256, 512]] * LAYERS
    counts = state["telemetry"]["sparse"]
    calls = counts["forward_mqa:reference"]
    # every MLA call ran our kpool indexer first and wrote its latent through our writer
    assert counts["indexer:kpool:cpu"] == calls == counts[f"kv_write:{KV_DTYPES[kv]}"]
    # At least one call per layer per step. vLLM treats Glm5NextForCausalLM as hybrid (KDA)
    # even with no KDA layer: its mamba page raises the attention block to 4608 tokens, the
    # 64 MiB cache holds 6 blocks, two requests run at once and the third after them (16
    # steps at TP 1; at TP 2 a rank's mamba page is half and all three run: 8 steps)
    assert calls % LAYERS == 0 and calls >= MAX_TOKENS * LAYERS
    assert "indexer:cpu" not in counts  # the V3.2 indexer never ran
    outcome = state["plugin"]["sparse-cpu"]
    assert "Indexer.__init__ (when vllm.models.glm5next.common.attention is imported)" in outcome
    log = report["log"]
    assert "registered the portable kpool indexer (SparseAttnIndexerKpool.register_oot)" in log
    assert "fused q/kv RMSNorm in torch" in log


def test_reload_serves_the_second_checkpoint_at_the_same_addresses(
    glm5_models, glm5_engine, prompt_ids
):
    report = glm5_engine["bfloat16"]
    assert report["state_reloaded"]["pointers"] == report["state_first"]["pointers"]
    want = reference(glm5_models["second"], prompt_ids, MAX_TOKENS, "bf16")
    assert_match(report["reloaded"], want, "bfloat16", BF16_MEDIAN_TOL)
    first = reference(glm5_models["first"], prompt_ids, MAX_TOKENS, "bf16")
    assert not compare(report["reloaded"], first).same_tokens  # the reload changed the model


@pytest.mark.topology
@pytest.mark.parametrize("phase", ["first", "reloaded"])
def test_tp2_matches_the_reference_with_half_the_heads_per_rank(
    glm5_models, glm5_tp2, prompt_ids, phase
):
    """TP 2: each rank holds 2 of the 4 heads' pairs at the same addresses after the reload,
    ran our kpool indexer, backend and writer on every MLA call, and the generation matches
    the reference as TP 1's does (a TP all-reduce adds bf16 partial sums in another order:
    within the bf16 error model above)."""
    model = glm5_models["first" if phase == "first" else "second"]
    want = reference(model, prompt_ids, MAX_TOKENS, "bf16")
    assert_match(glm5_tp2[phase], want, "bfloat16", BF16_MEDIAN_TOL)
    states = glm5_tp2[f"states_{phase}"]
    assert len({s["telemetry"]["pid"] for s in states}) == 2
    for before, state in zip(glm5_tp2["states_first"], states, strict=True):
        assert state["pointers"] == before["pointers"]
        assert [shape[0][0] for shape in state["pair_shapes"].values()] == [2] * LAYERS
        counts = state["telemetry"]["sparse"]
        calls = counts["forward_mqa:reference"]
        assert counts["indexer:kpool:cpu"] == calls == counts["kv_write:bf16"]
        assert calls >= MAX_TOKENS * LAYERS
