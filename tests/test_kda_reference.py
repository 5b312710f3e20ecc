"""The KDA reference (``vllm_mla.ops.kda``): the delta rule against the paper's ``[K, V]``
form written out here, prefill and decode agreeing on one sequence, and the cache rules of
vLLM's recurrent kernel (null slots, speculative starts, one state per token).

Tolerances: everything is fp32 in both computations; they differ by summation order
only, relative error about T * 2**-24 per accumulated value over T <= 16 tokens of
128-wide dots, so 1e-5 absolute on O(1) values.
"""

from __future__ import annotations

import pytest
import torch

from vllm_mla.ops import kda

H, D = 2, 128
LOWER = -5.0
TOL = 1e-5  # fp32 reassociation (module docstring)


def _inputs(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "q": randn(1, tokens, H, D),
        "k": randn(1, tokens, H, D),
        "v": randn(1, tokens, H, D),
        "raw_g": randn(1, tokens, H, D),
        "beta_logits": randn(1, tokens, H),
        "a_log": randn(H) * 0.5,
        "g_bias": randn(H * D),
    }


def _paper(x: dict[str, torch.Tensor], initial: torch.Tensor | None = None):
    """The delta rule as written for a ``[K, V]`` state: decay the rows by exp(g), correct
    toward v along k with rate beta, read with the scaled, normalized q."""
    heads_g = x["raw_g"][0] + x["g_bias"].view(H, D)
    g = LOWER * torch.sigmoid(x["a_log"].exp()[:, None] * heads_g)
    beta = x["beta_logits"][0].sigmoid()
    s = torch.zeros(H, D, D) if initial is None else initial.clone()
    out = []
    for t in range(x["q"].shape[1]):
        q = torch.nn.functional.normalize(x["q"][0, t], dim=-1, eps=0) * D**-0.5
        k = torch.nn.functional.normalize(x["k"][0, t], dim=-1, eps=0)
        s = s * g[t].exp()[:, :, None]
        err = x["v"][0, t] - torch.einsum("hkv,hk->hv", s, k)
        s = s + torch.einsum("hk,hv->hkv", k, beta[t][:, None] * err)
        out.append(torch.einsum("hkv,hk->hv", s, q))
    return torch.stack(out), s


def _chunk(x, initial=None, cu=None):
    return kda.chunk_with_fused_gate(
        x["q"],
        x["k"],
        x["v"],
        x["raw_g"],
        x["beta_logits"].sigmoid(),
        x["a_log"],
        x["g_bias"],
        None,
        initial,
        cu,
        LOWER,
    )


def test_prefill_is_the_delta_rule_with_the_state_stored_as_v_by_k():
    x = _inputs(12)
    out, final = _chunk(x)
    want_out, want_state = _paper(x)
    torch.testing.assert_close(out[0], want_out, atol=TOL, rtol=0)
    # vLLM's cache holds [H, V, K]: the transpose of the paper's state
    torch.testing.assert_close(final[0], want_state.transpose(-1, -2), atol=TOL, rtol=0)


def test_prefill_sequences_start_from_their_own_states():
    a, b = _inputs(5, seed=1), _inputs(7, seed=2)
    both = {name: torch.cat([a[name], b[name]], 1) for name in ("q", "k", "v", "raw_g")}
    both["beta_logits"] = torch.cat([a["beta_logits"], b["beta_logits"]], 1)
    both["a_log"], both["g_bias"] = a["a_log"], a["g_bias"]
    b["a_log"], b["g_bias"] = a["a_log"], a["g_bias"]
    initial = torch.randn(2, H, D, D) * 0.1
    out, finals = _chunk(both, initial, torch.tensor([0, 5, 12]))
    for n, (x, rows) in enumerate(((a, slice(0, 5)), (b, slice(5, 12)))):
        want_out, want_state = _paper(x, initial[n].transpose(-1, -2))
        torch.testing.assert_close(out[0, rows], want_out, atol=TOL, rtol=0)
        torch.testing.assert_close(finals[n], want_state.transpose(-1, -2), atol=TOL, rtol=0)


def _decode(x, state, indices, cu, accepted=None, out=None):
    return kda.fused_recurrent(
        x["q"],
        x["k"],
        x["v"],
        x["raw_g"],
        x["beta_logits"],
        state,
        indices,
        cu,
        num_accepted_tokens=accepted,
        a_log=x["a_log"],
        g_bias=x["g_bias"],
        lower_bound=LOWER,
        sigmoid_beta=True,
        out=out,
    )


def test_decode_one_token_at_a_time_continues_the_prefill():
    x = _inputs(9)
    _, final = _chunk(x)
    prompt = {name: t[:, :6] if t.ndim > 2 else t for name, t in x.items()}
    prompt["beta_logits"] = x["beta_logits"][:, :6]
    _, after_prompt = _chunk(prompt)
    cache = torch.zeros(4, H, D, D)
    cache[3] = after_prompt[0]
    whole, _ = _paper(x)
    for t in range(6, 9):
        step = {n: v[:, t : t + 1] if n not in ("a_log", "g_bias") else v for n, v in x.items()}
        o = _decode(step, cache, torch.tensor([3]), torch.tensor([0, 1]))
        torch.testing.assert_close(o[0, 0], whole[t], atol=TOL, rtol=0)
    torch.testing.assert_close(cache[3], final[0], atol=TOL, rtol=0)
    assert not cache[:3].any()  # no other slot written


def test_a_null_slot_is_neither_read_nor_written():
    x = _inputs(1)
    cache = torch.randn(3, H, D, D)
    before = cache.clone()
    out = torch.full((1, 1, H, D), 7.0)
    _decode(x, cache, torch.tensor([0]), torch.tensor([0, 1]), out=out)
    assert torch.equal(cache, before) and (out == 7.0).all()


def test_speculative_verification_starts_at_the_last_accepted_state_and_keeps_each():
    """Three draft tokens verified from column ``accepted - 1``; token i's state goes to
    column i, as vLLM's spec-decode state indices lay them out."""
    x = _inputs(3, seed=4)
    cache = torch.zeros(8, H, D, D)
    start = torch.randn(H, D, D) * 0.1
    cache[6] = start  # column 1 of the row below: accepted 2
    indices = torch.tensor([[5, 6, 7]])
    o = _decode(x, cache, indices, torch.tensor([0, 3]), accepted=torch.tensor([2]))
    want_out, _ = _paper(x, start.transpose(-1, -2))
    torch.testing.assert_close(o[0], want_out, atol=TOL, rtol=0)
    for i, slot in enumerate((5, 6, 7)):
        prefix = {n: v[:, : i + 1] if n not in ("a_log", "g_bias") else v for n, v in x.items()}
        _, state = _paper(prefix, start.transpose(-1, -2))
        torch.testing.assert_close(cache[slot], state.transpose(-1, -2), atol=TOL, rtol=0)


def test_gather_zeroes_requests_without_a_state_and_scatter_writes_back():
    state = torch.randn(5, H, 3, 3)
    rows = kda.gather_initial_states(state, torch.tensor([4, 2]), torch.tensor([True, False]))
    assert torch.equal(rows[0], state[4]) and not rows[1].any()
    kda.scatter_states(state, rows + 1, torch.tensor([1, 3]))
    assert torch.equal(state[1], rows[0] + 1) and torch.equal(state[3], rows[1] + 1)


def test_the_unbounded_gate_is_refused_by_name():
    x = _inputs(1)
    with pytest.raises(kda.KDAError, match="lower_bound"):
        kda.fused_recurrent(
            x["q"],
            x["k"],
            x["v"],
            x["raw_g"],
            x["beta_logits"],
            torch.zeros(2, H, D, D),
            torch.tensor([1]),
            torch.tensor([0, 1]),
            a_log=x["a_log"],
            g_bias=x["g_bias"],
            lower_bound=None,
        )
