"""A tiny GLM-5.3-Flash (``Glm5NextForCausalLM``: MLA of latent 512 without RoPE, the kpool
indexer) served end to end by vLLM CPU through B12X_MLA_SPARSE, the plugin's portable kpool
indexer and its torch stand-ins for the Triton kernels GLM-5.3-Flash's path launches.

The checkpoint (``make_model(..., TinyModelSpec(arch="glm5-next", ...))``): 2 layers, both
MLA (``test_glm5next_kda_engine`` runs the KDA + MLA pattern), 4 heads of qk_nope 256 / v 256,
rope 0, a kpool indexer per layer (32 heads, pools of 16, the tail pool always selected),
dense MLPs, no mHC (vLLM CPU's mHC ops drop the layer's input RMSNorm:
``tiny_glm5next``). ``index_topk`` is 16: one pool of 16 (and the tail) out of up to five
complete pools of the 80-token prompt, so which pool the indexer keeps decides the output
(``test_the_selection_decides_and_its_near_ties_are_counted``). The engine serves it in
bf16, as vLLM's GLM-5-next code requires (the error model below); KV cache ``bfloat16``
(512-wide records) and ``fp8`` (``fp8_ds_mla``, 656-byte records with an empty RoPE slot);
three prompts in one batch, then ``reload_weights`` with a second checkpoint; and the
bf16-record engine again at TP 2 (marker ``topology``).

The reference (``glm5next_reference``) is transformers' own GLM-5-next layers in fp32 with
vLLM's non-mHC residual, vLLM's kpool selection (bf16 indexer inputs, Hadamard, e4m3
queries and pool keys) and the latent rounded through the cache records.
"""

from __future__ import annotations

import os

import pytest
import torch
from compare import compare
from conftest import KV_DTYPES
from dsa_reference import BoundaryMargins, Decisions
from engine_job import MAX_TOKENS, SPARSE_BACKEND, SPARSE_PROMPTS
from glm5next_match import (
    INDEX_TOPK,
    KPOOL,
    POOL_TIE_RELATIVE,
    POOLS_SELECTED,
    bf16_engines,
    checkpoints,
    matcher,
    top5,
)
from glm5next_reference import load, reference

from vllm_mla.tools.tinymodel import TinyModelSpec

LAYERS = 2


def spec(seed: int) -> TinyModelSpec:
    return TinyModelSpec(arch="glm5-next", layers=LAYERS, index_topk=INDEX_TOPK, seed=seed)


@pytest.fixture(scope="session")
def glm5_models(tmp_path_factory) -> dict:
    """``first`` and ``second`` (the reload) tiny GLM-5.3-Flash checkpoints."""
    return checkpoints(tmp_path_factory.mktemp("glm5next-models"), spec)


@pytest.fixture(scope="session")
def glm5_engine(glm5_models, tmp_path_factory) -> dict[str, dict]:
    """{"bfloat16"|"fp8": the bf16 engine on the checkpoints, TP 1}."""
    return bf16_engines(glm5_models, tmp_path_factory.mktemp("glm5next-engine"), tuple(KV_DTYPES))


@pytest.fixture(scope="session")
def glm5_tp2(glm5_models, tmp_path_factory) -> dict:
    """The bf16-record engine at TP 2 (one CPU core per rank), first and reloaded."""
    out = tmp_path_factory.mktemp("glm5-tp2")
    return bf16_engines(glm5_models, out, ("bfloat16",), tensor_parallel_size=2)["bfloat16"]


@pytest.fixture(scope="session")
def prompt_ids(glm5_engine) -> list[list[int]]:
    return [r["prompt_token_ids"] for r in glm5_engine["bfloat16"]["first"]]


@pytest.fixture(scope="session")
def selecting(prompt_ids) -> list[int]:
    """The prompts longer than top-k: the indexer drops tokens from their attention."""
    return [i for i, ids in enumerate(prompt_ids) if len(ids) > INDEX_TOPK]


@pytest.fixture(scope="session")
def match(glm5_models, prompt_ids, selecting):
    """``glm5next_match.matcher`` on the all-MLA checkpoints."""
    return matcher(glm5_models, prompt_ids, selecting)


def test_transformers_builds_the_checkpoint_and_every_tensor_loads(glm5_models):
    """``load`` asserts every checkpoint tensor is used; the text config is what vLLM
    serves (latent 512, no RoPE, kpool 16 with the tail, all MLA, no mHC)."""
    model, _ = load(glm5_models["first"])
    config = model.config
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim) == (512, 0, 256)
    assert config.index_kpool == KPOOL and config.index_kpool_always_select_tail
    assert set(config.layer_types) == {"indexed_attention"} and not config.mhc
    assert all(layer.self_attn.indexer is not None for layer in model.layers)


def test_top_k_is_under_a_third_of_the_longest_context(prompt_ids):
    """The premise that makes the indexer's choice decide the output: one pool of 16 (and
    the tail) out of up to 5 complete pools."""
    lengths = [len(ids) for ids in prompt_ids]
    assert len(lengths) == len(SPARSE_PROMPTS)
    assert max(lengths) + MAX_TOKENS > 3 * INDEX_TOPK
    assert max(lengths) > 4 * 16  # several complete pools and a tail


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_greedy_tokens_and_logprobs_match_the_reference(glm5_engine, match, kv):
    match(glm5_engine[kv]["first"], "first", KV_DTYPES[kv])


class LowestPools(Decisions):
    """Selects each query's lowest-scoring complete pools: a wrong selection."""

    def selected(self, layer: int, scores: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
        out = picked.clone()
        for t in range(scores.shape[0]):
            n = (t + 1) // KPOOL
            if n:
                low = scores[t, :n].argsort()[: picked.shape[1]]
                out[t, : low.numel()] = low.to(out.dtype)
        return out


def test_the_selection_decides_and_its_near_ties_are_counted(glm5_models, prompt_ids, match):
    """Selecting each query's lowest pools instead of its highest is caught by the
    comparison the engine passes: it sees the selection. Near-ties among the emulated
    selections are counted and reported (the perturbed references reproduce them)."""
    margins = BoundaryMargins(POOLS_SELECTED, grain=KPOOL)
    reference(glm5_models["first"], prompt_ids, MAX_TOKENS, "bf16", decisions=margins)
    ties = margins.near_ties(POOL_TIE_RELATIVE)
    print(
        f"{len(margins.gaps)} pool selections, {ties} near-ties (gap < {POOL_TIE_RELATIVE}), "
        f"smallest gap {min(margins.gaps):.1e}"
    )
    assert margins.gaps and ties < len(margins.gaps) / 4
    wrong = reference(glm5_models["first"], prompt_ids, MAX_TOKENS, "bf16", decisions=LowestPools())
    with pytest.raises(AssertionError, match=r"median|near-tie"):
        match(top5(wrong), "first", "bf16")


def test_the_tail_pool_is_attended(glm5_models, glm5_engine, prompt_ids):
    """The same reference without the tail pool (``index_kpool_always_select_tail`` off)
    is another model: the engine's match above needs the tail on both sides."""
    no_tail = reference(glm5_models["first"], prompt_ids, MAX_TOKENS, "bf16", tail="dropped")
    c = compare(glm5_engine["bfloat16"]["first"], no_tail)
    assert not c.same_tokens and c.median > 0.5, c.median


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
    glm5_models, glm5_engine, prompt_ids, match
):
    report = glm5_engine["bfloat16"]
    assert report["state_reloaded"]["pointers"] == report["state_first"]["pointers"]
    match(report["reloaded"], "second", "bf16")
    first = reference(glm5_models["first"], prompt_ids, MAX_TOKENS, "bf16")
    assert not compare(report["reloaded"], first).same_tokens  # the reload changed the model


@pytest.mark.topology
@pytest.mark.parametrize("phase", ["first", "reloaded"])
def test_tp2_matches_the_reference_with_half_the_heads_per_rank(glm5_tp2, match, phase):
    """TP 2: each rank holds 2 of the 4 heads' pairs at the same addresses after the reload,
    ran our kpool indexer, backend and writer on every MLA call, and the generation matches
    the reference as TP 1's does (a TP all-reduce adds bf16 partial sums in another order:
    within the bf16 error model above)."""
    match(glm5_tp2[phase], "first" if phase == "first" else "second", "bf16")
    states = glm5_tp2[f"states_{phase}"]
    assert len({s["telemetry"]["pid"] for s in states}) == 2
    for before, state in zip(glm5_tp2["states_first"], states, strict=True):
        assert state["pointers"] == before["pointers"]
        assert [shape[0][0] for shape in state["pair_shapes"].values()] == [2] * LAYERS
        counts = state["telemetry"]["sparse"]
        calls = counts["forward_mqa:reference"]
        assert counts["indexer:kpool:cpu"] == calls == counts["kv_write:bf16"]
        assert calls >= MAX_TOKENS * LAYERS
