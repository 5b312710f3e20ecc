"""One comparison of two generations (an engine's against a reference or another engine),
and the tolerances the end-to-end tests hold them to, each with its error model.

A generation is a list (one per prompt) of ``{"token_ids": [...], "logprobs": [...]}``;
``logprobs[step]`` is the engine's top-5 ``{token: logprob}`` or a reference's full
vocabulary tensor. Log-probabilities are compared for the engine's reported tokens, step by
step, up to the first step whose preceding tokens differ.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# Dense MLA, both sides fp32 with the same (or no) quantization: only the order of fp32 sums
# differs. Each sum of n <= 1024 products (hidden 256, latent 512, MLP 512) rounds with
# independent errors, ~sqrt(n) * 2^-24 ~ 2e-6 of its magnitude; about ten such sums stand
# between the input and a logit (|logit| <= ~10 in these tiny models): ~2e-4 per logit, and a
# log-probability is a difference of two of them: 5e-4 (measured worst 3.4e-5).
DENSE_LOGPROB_TOL = 5e-4

# DSA models (sparse MLA + lightning indexer, quantized KV and index keys/queries): the same
# continuous part, plus flipped decisions. A value that lands within the fp32 noise above of
# a rounding boundary can come out the other way on another CPU's kernels: one element of a
# cached latent (bf16 / e4m3), one index query or key element (e4m3), or the K-th and
# (K+1)-th token of a top-k. tests_e2e/flip_effect.py forces single flips at the decisions
# with the smallest margins in the emulating reference: a latent element moves this model's
# top-5 log-probabilities by <= 2.1e-3. Allowing ~10 of them: 2e-2 for the worst entry.
# A swap next to a token that dominates an attention row moves them by nats and may change a
# greedy token: none occurs in these prompts at a margin fp32 noise can reach on the CPUs
# the suite runs on (greedy tokens are still required to be identical).
SPARSE_LOGPROB_TOL = 2e-2
# Scattered flips move a few entries; an arithmetic error (a wrong scale, RoPE, index) moves
# most of them: the median entry stays within the continuous part plus one flip's effect.
SPARSE_MEDIAN_TOL = 2.5e-3


@dataclass
class Comparison:
    """Tokens identical per prompt; every compared log-probability difference."""

    tokens_equal: list[bool] = field(default_factory=list)
    diffs: list[float] = field(default_factory=list)
    worst: float = 0.0
    worst_at: str = ""

    @property
    def same_tokens(self) -> bool:
        return all(self.tokens_equal)

    @property
    def median(self) -> float:
        return statistics.median(self.diffs) if self.diffs else 0.0

    def first_token_divergence(self) -> str:
        bad = [i for i, same in enumerate(self.tokens_equal) if not same]
        return f"greedy tokens differ for prompt(s) {bad}" if bad else ""


def _logprob(step_logprobs, token: str) -> float | None:
    """The reference's log-probability of ``token``; None when an engine's top-5 lacks it
    (a near-tie at fifth place: the sets are compared where a test needs them equal)."""
    if isinstance(step_logprobs, dict):
        return step_logprobs.get(token)
    return step_logprobs[int(token)].item()


def compare(got: list[dict], want: list[dict]) -> Comparison:
    """``got`` (an engine's generation) against ``want`` (a reference's or an engine's)."""
    result = Comparison()
    for i, (ours, ref) in enumerate(zip(got, want, strict=True)):
        result.tokens_equal.append(ours["token_ids"] == ref["token_ids"])
        for step, top in enumerate(ours["logprobs"]):
            if ours["token_ids"][:step] != ref["token_ids"][:step]:
                break
            for token, logprob in top.items():
                theirs = _logprob(ref["logprobs"][step], token)
                if theirs is None:
                    continue
                diff = abs(logprob - theirs)
                result.diffs.append(diff)
                if diff > result.worst:
                    result.worst, result.worst_at = diff, f"prompt {i} step {step} token {token}"
    return result


def assert_dense_match(got: list[dict], want: list[dict]) -> Comparison:
    """Greedy tokens identical, every compared log-probability within DENSE_LOGPROB_TOL."""
    c = compare(got, want)
    assert c.same_tokens, c.first_token_divergence()
    assert c.worst <= DENSE_LOGPROB_TOL, f"{c.worst_at}: {c.worst:.2e} > {DENSE_LOGPROB_TOL}"
    return c


# nvfp4_ds_mla records: the same count of flipped decisions, but a flipped latent element
# moves by an e2m1 step, up to 2 sf = amax / 3 of its 16-block, where an e4m3 flip moves
# by at most 32 / 448 = amax / 14 of its group: each flip's effect scales by 14 / 3.
NVFP4_FLIP_SCALE = 14 / 3


def assert_sparse_match(got: list[dict], want: list[dict], scale: float = 1.0) -> Comparison:
    """Greedy tokens identical; worst log-probability difference within SPARSE_LOGPROB_TOL,
    the median within SPARSE_MEDIAN_TOL (both times ``scale``: NVFP4_FLIP_SCALE for nvfp4
    records)."""
    c = compare(got, want)
    worst, median = SPARSE_LOGPROB_TOL * scale, SPARSE_MEDIAN_TOL * scale
    assert c.same_tokens, c.first_token_divergence()
    assert c.worst <= worst, f"{c.worst_at}: {c.worst:.2e} > {worst:.2e}"
    assert c.median <= median, f"median {c.median:.2e} > {median:.2e}"
    return c
