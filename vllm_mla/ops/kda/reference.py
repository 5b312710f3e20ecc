"""KDA (Kimi delta attention, GLM-5.3-Flash's linear-attention layers) in plain torch: what
vLLM's Triton kernels compute, for hosts without Triton (vLLM CPU).

Numeric contract (vLLM's ``fused_recurrent_kda`` / ``chunk_kda_with_fused_gate``):

- everything in fp32; q and k L2-normalized per head (``x / sqrt(sum x^2 + 1e-6)``), the
  query scaled by ``scale`` (default ``head_dim ** -0.5``);
- the bounded ("safe") gate ``g = lower_bound * sigmoid(exp(A_log[h]) * (raw_g + g_bias))``
  per channel, a log-decay in ``[lower_bound, 0]``;
- per token, with the state ``S`` ``[V, K]`` per head (vLLM's cache layout, the transpose
  of the paper's): ``S *= exp(g)`` over K, ``u = beta * (v - S k)``, ``S += u k^T``,
  ``o = S q``;
- the state is stored in the cache's dtype after each sequence (prefill) or each token
  (decode, every token's state for speculative decoding); outputs in q's dtype.

The chunked prefill kernel computes the same recurrence block-wise (cumulative gates within
64-token chunks); this walks it token by token, equal up to fp32 reassociation.
"""

from __future__ import annotations

import itertools

import torch

L2_EPS = 1e-6  # the kernels' l2norm eps (use_qk_l2norm_in_kernel)
NULL_STATE = 0  # vLLM's NULL_BLOCK_ID: a state index <= 0 is never read or written


class KDAError(ValueError):
    """A KDA call this reference does not serve, naming the argument."""


def safe_gate(
    raw_g: torch.Tensor, a_log: torch.Tensor, g_bias: torch.Tensor | None, lower_bound: float
) -> torch.Tensor:
    """The bounded gate, fp32 ``[..., H, K]`` from raw ``[..., H, K]``; ``a_log`` holds one
    value per head (any shape of H elements), ``g_bias`` H * K values or None."""
    heads, dim = raw_g.shape[-2:]
    g = raw_g.float()
    if g_bias is not None:
        g = g + g_bias.float().reshape(heads, dim)
    rate = a_log.float().reshape(heads, 1).exp()
    return lower_bound * torch.sigmoid(rate * g)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """One token for every head: ``state`` fp32 ``[H, V, K]`` updated in place; q (scaled),
    k (normalized), g ``[H, K]``, v ``[H, V]``, beta ``[H]``; returns o ``[H, V]``."""
    state.mul_(g.exp()[:, None, :])
    u = (v - torch.einsum("hvk,hk->hv", state, k)) * beta[:, None]
    state.add_(u[:, :, None] * k[:, None, :])
    return torch.einsum("hvk,hk->hv", state, q)


def _prepared(q, k, scale):
    q, k = l2norm(q), l2norm(k)
    return q * (scale if scale is not None else q.shape[-1] ** -0.5), k


def _segments(cu_seqlens: torch.Tensor | None, tokens: int) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, tokens)]
    bounds = [int(x) for x in cu_seqlens.tolist()]
    return list(itertools.pairwise(bounds))


def chunk_with_fused_gate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    raw_g: torch.Tensor,
    beta: torch.Tensor,
    a_log: torch.Tensor,
    g_bias: torch.Tensor | None,
    scale: float | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    lower_bound: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill: q/k/v/raw_g ``[1, T, H, K]``, beta ``[1, T, H]`` (already sigmoided), the
    sequences ``cu_seqlens`` (None: one), ``initial_state`` ``[N, H, V, K]`` (None: zeros).
    Returns (o ``[1, T, H, V]`` in q's dtype, final states fp32 ``[N, H, V, K]``)."""
    if q.shape[0] != 1:
        raise KDAError(f"q: batch {q.shape[0]}; the varlen layout is [1, T, H, K]")
    qs, ks = _prepared(q[0], k[0], scale)
    g = safe_gate(raw_g[0], a_log, g_bias, lower_bound)
    vs, bs = v[0].float(), beta[0].float()
    segments = _segments(cu_seqlens, q.shape[1])
    heads, dim_v, dim_k = v.shape[2], v.shape[3], q.shape[3]
    finals = torch.zeros(len(segments), heads, dim_v, dim_k)
    if initial_state is not None:
        finals.copy_(initial_state.float())
    out = torch.zeros(q.shape[1], heads, dim_v)
    for n, (start, end) in enumerate(segments):
        for t in range(start, end):
            out[t] = step(finals[n], qs[t], ks[t], vs[t], g[t], bs[t])
    return out.to(q.dtype)[None], finals


def fused_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    a_log: torch.Tensor | None = None,
    g_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    sigmoid_beta: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode and speculative verification against the cache, in place: q/k/v/g
    ``[1, T, H, K]``, beta ``[1, T, H]``, ``state`` ``[slots, H, V, K]``. Sequence n
    (``cu_seqlens``) starts from slot ``state_indices[n, a - 1]`` (``a`` its accepted
    tokens, 1 without ``num_accepted_tokens``; 1-D indices: one column) and writes the
    state after its token i to ``state_indices[n, i]``; a slot <= 0 (vLLM's null block)
    skips the sequence, or the write. With ``a_log`` the gate is computed from raw ``g``
    (``lower_bound`` required); with ``sigmoid_beta`` beta holds logits. Returns o
    ``[1, T, H, V]`` (into ``out`` when given) in q's dtype."""
    if a_log is not None and lower_bound is None:
        raise KDAError("compute_gate without lower_bound: only the bounded gate is served")
    qs, ks = _prepared(q[0], k[0], scale)
    gs = g[0].float() if a_log is None else safe_gate(g[0], a_log, g_bias, lower_bound)
    bs = beta[0].float().sigmoid() if sigmoid_beta else beta[0].float()
    vs = v[0].float()
    indices = state_indices if state_indices.ndim == 2 else state_indices[:, None]
    o = out if out is not None else torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for n, (start, end) in enumerate(_segments(cu_seqlens, q.shape[1])):
        first = 0 if num_accepted_tokens is None else int(num_accepted_tokens[n]) - 1
        slot = int(indices[n, first])
        if end == start or slot <= NULL_STATE:
            continue
        h = state[slot].float().clone()  # the kernel works in registers: never aliased
        for i, t in enumerate(range(start, end)):
            o[0, t] = step(h, qs[t], ks[t], vs[t], gs[t], bs[t]).to(o.dtype)
            target = int(indices[n, i])
            if target > NULL_STATE:
                state[target] = h.to(state.dtype)
    return o


def gather_initial_states(
    state: torch.Tensor, indices: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """Rows ``state[indices[n]]``, zeros where ``has_initial_state[n]`` is False."""
    rows = state[indices.long().clamp(min=0)]
    return torch.where(has_initial_state.reshape(-1, *[1] * (state.ndim - 1)), rows, 0)


def scatter_states(state: torch.Tensor, src: torch.Tensor, indices: torch.Tensor) -> None:
    """``state[indices] = src`` in the cache's dtype (slots are unique per sequence)."""
    state[indices.long()] = src.to(state.dtype)
