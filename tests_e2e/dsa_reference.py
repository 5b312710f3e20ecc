"""The fp32 reference for the sparse (DSA) end-to-end runs: transformers' own DeepseekV32
model, made to compute what vLLM computes where the two legitimately differ.

transformers scores the lightning indexer in fp32 and keeps the latent KV in fp32;
vLLM quantizes the indexer's queries and keys to e4m3 (power-of-two scales) before
scoring, and attends over KV rounded to the cache's records. Both change which tokens
are selected and every later logit, so a plain transformers run diverges at the first
token of a prompt longer than top-k. This reference patches exactly those two points:

- ``DeepseekV32Indexer.forward``: the same projections, norm and RoPE as transformers,
  then vLLM's indexer arithmetic from ``vllm_mla.ops.sparse_indexer`` (the same functions
  the plugin serves the CPU engine with): queries quantized per head (ue8m0, eps 1e-10),
  keys per token (ue8m0, floor 1e-4), logits ``k_scale * sum_h w * relu(q . k)``, top-k
  with ties toward the lower position;
- the latent KV: ``kv_a_layernorm``'s output and the roped ``k_pe`` are passed through the
  cache format (bf16 records, ``fp8_ds_mla``'s e4m3 + per-128 scales and bf16 k_pe, or
  ``nvfp4_ds_mla``'s e2m1 + per-16 e4m3 scales and e4m3 k_pe: the records' own codec).

Everything else (projections, RMSNorms, interleaved MLA RoPE, attention, MLP) is
transformers' own fp32 code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from vllm_mla.ops import sparse_indexer
from vllm_mla.ops.sparse_mla import pack_rows
from vllm_mla.ops.sparse_mla.formats import unpack_records

QUERY_EPS = 1e-10  # vLLM's per_token_group_quant_fp8 default


def round_kv_c(kv_c: torch.Tensor, kv_format: str) -> torch.Tensor:
    """``kv_c [..., 512]`` as the cache gives it back (bf16, or e4m3 x per-128 scale)."""
    flat = kv_c.reshape(-1, kv_c.shape[-1])
    records = pack_rows(flat, torch.zeros(flat.shape[0], 64), kv_format)
    return unpack_records(records, kv_format)[0].reshape(kv_c.shape).to(kv_c.dtype)


def round_k_pe(k_pe: torch.Tensor, kv_format: str) -> torch.Tensor:
    """The roped ``k_pe`` as the cache gives it back (bf16 in bf16 and fp8_ds_mla records,
    e4m3 in nvfp4_ds_mla's)."""
    flat = k_pe.reshape(-1, k_pe.shape[-1])
    records = pack_rows(torch.zeros(flat.shape[0], 512), flat, kv_format)
    return unpack_records(records, kv_format)[1].reshape(k_pe.shape).to(k_pe.dtype)


@contextlib.contextmanager
def replaced(owner: object, **attributes: object) -> Iterator[None]:
    """``owner``'s named attributes replaced for the block; the originals put back after."""
    originals = {name: getattr(owner, name) for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(owner, name, value)


@contextlib.contextmanager
def latent_through(attention: torch.nn.Module, cached) -> Iterator[None]:
    """``attention.kv_a_layernorm(x)`` gives ``cached(norm(x))`` for the block: an instance
    attribute shadowing the submodule (a module attribute cannot be set to a function)."""
    norm = attention.kv_a_layernorm
    attention.__dict__["kv_a_layernorm"] = lambda x: cached(norm(x))
    try:
        yield
    finally:
        del attention.__dict__["kv_a_layernorm"]


def vllm_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    layer: int,
    decisions: Decisions | None = None,
) -> torch.Tensor:
    """vLLM's DSA selection from the roped indexer query ``q [B, S, H, D]``, key ``k [B, S,
    D]`` and per-head weights ``[B, S, H]`` (softmax scale applied): queries and keys
    quantized per row (ue8m0), logits ``k_scale * sum_h w q_scale / sqrt(H) relu(q . k)``,
    top-k of every causal prefix, ties toward the lower position. int ``[B, S, topk']``
    padded with a selected position (transformers scatters the indices into a mask)."""
    decisions = decisions or Decisions()
    batch, seq, heads, _ = q.shape
    q_fp8, q_scale = sparse_indexer.quantize_rows(q, ue8m0=True, floor=QUERY_EPS)
    k_fp8, k_scale = sparse_indexer.quantize_rows(k, ue8m0=True)
    weights = weights.float() * q_scale * heads**-0.5
    lengths = torch.arange(1, seq + 1)  # whole causal prefix of every query
    out = []
    for b in range(batch):
        scores = sparse_indexer.logits(q_fp8[b].float(), weights[b], k_fp8[b], k_scale[b])
        picked = sparse_indexer.select_topk(scores, lengths, topk)
        picked = decisions.selected(layer, scores, picked)
        out.append(torch.where(picked >= 0, picked, picked[:, :1]))
    return torch.stack(out)


class Decisions:
    """Hooks on the reference's discrete decisions (``flip_effect.py`` forces single ones
    the other way): ``selected(layer, scores, picked)`` returns the top-k to use,
    ``latent(layer, exact, rounded)`` the cached latent to use (both ``[seq, ...]``)."""

    def selected(self, layer: int, scores: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
        return picked

    def latent(self, layer: int, exact: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
        return rounded


class BoundaryMargins(Decisions):
    """Records, per selection with more candidates than ``topk``, the relative gap between
    the last selected score and the best dropped one: ``(s_k - s_{k+1}) / |s_1|``, and
    where it was taken (``at``: the number of the ``selected`` call, the query row). A gap
    below the scoring's own rounding noise is an index near-tie another summation order
    could flip (``near_ties``; ``FlipAt`` flips one)."""

    def __init__(self, topk: int, grain: int = 1) -> None:
        self.topk = topk  # in candidates: tokens, or pools of ``grain`` tokens (kpool)
        self.grain = grain
        self.gaps: list[float] = []
        self.at: list[tuple[int, int]] = []
        self._calls = 0

    def selected(self, layer: int, scores: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
        for t in range(scores.shape[0]):
            row = scores[t, : (t + 1) // self.grain]  # the candidates query t may select
            if row.numel() > self.topk:
                top = row.topk(self.topk + 1).values
                self.gaps.append(float((top[-2] - top[-1]) / top[0].abs().clamp(min=1e-30)))
                self.at.append((self._calls, t))
        self._calls += 1
        return picked

    def near_ties(self, relative: float) -> int:
        return sum(gap < relative for gap in self.gaps)

    def closest(self, n: int) -> list[tuple[int, int]]:
        """Where the ``n`` smallest gaps were (the decisions noise flips first)."""
        order = sorted(range(len(self.gaps)), key=self.gaps.__getitem__)
        return [self.at[i] for i in order[:n]]


class FlipAt(Decisions):
    """One selection forced the other way: at ``at`` (from ``BoundaryMargins``, recorded on
    the same inputs) the last selected candidate gives its place to the best dropped one,
    what a host whose rounding lands on the other side of that near-tie selects."""

    def __init__(self, at: tuple[int, int], topk: int, grain: int = 1) -> None:
        self.call, self.row = at
        self.topk, self.grain = topk, grain
        self._calls = 0

    def selected(self, layer: int, scores: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
        self._calls += 1
        if self._calls - 1 != self.call:
            return picked
        t = self.row
        order = scores[t, : (t + 1) // self.grain].topk(self.topk + 1).indices
        out = picked.clone()
        slot = (out[t] == order[-2]).nonzero()
        assert slot.numel() == 1, f"row {t}: {order[-2]} not selected once in {out[t].tolist()}"
        out[t, slot[0, 0]] = order[-1]
        return out


@contextlib.contextmanager
def emulating_vllm(kv_format: str, decisions: Decisions | None = None) -> Iterator[None]:
    """Patch transformers' DeepseekV32 as described in the module docstring."""
    decisions = decisions or Decisions()
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as m

    rope = m.apply_rotary_pos_emb
    rope_interleave = m.apply_rotary_pos_emb_interleave
    original_indexer = m.DeepseekV32Indexer.forward
    original_attention = m.DeepseekV32Attention.forward

    def indexer_forward(
        self,
        hidden_states,
        q_resid,
        position_embeddings,
        attention_mask,
        position_ids=None,
        past_key_values=None,
    ):
        batch, seq, _ = hidden_states.shape
        cos, sin = position_embeddings
        split = [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim]
        q = self.wq_b(q_resid).view(batch, seq, self.n_heads, self.head_dim)
        q_rot, q_pass = torch.split(q, split, -1)
        k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, split, -1)
        q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], -1)
        k = torch.cat([k_rot, k_pass], -1).squeeze(2)
        weights = self.weights_proj(hidden_states).float() * self.softmax_scale
        return vllm_topk(q, k, weights, self.index_topk, self.layer_idx, decisions)

    def attention_forward(self, *args, **kwargs):
        norm = self.kv_a_layernorm

        def rounded_rope(q, k, *a, **kw):
            q, k = rope_interleave(q, k, *a, **kw)
            return q, round_k_pe(k, kv_format)

        m.apply_rotary_pos_emb_interleave = rounded_rope

        def rounded_latent(x):
            exact = norm(x)
            rounded = round_kv_c(exact, kv_format)
            return decisions.latent(self.layer_idx, exact[0], rounded[0])[None]

        self.__dict__["kv_a_layernorm"] = rounded_latent
        try:
            return original_attention(self, *args, **kwargs)
        finally:
            m.apply_rotary_pos_emb_interleave = rope_interleave
            del self.__dict__["kv_a_layernorm"]

    m.DeepseekV32Indexer.forward = indexer_forward
    m.DeepseekV32Attention.forward = attention_forward
    try:
        yield
    finally:
        m.DeepseekV32Indexer.forward = original_indexer
        m.DeepseekV32Attention.forward = original_attention


def reference(
    model_dir,
    prompt_ids: list[list[int]],
    max_tokens: int,
    kv_format: str | None,
    decisions: Decisions | None = None,
    forced: list[list[int]] | None = None,
):
    """Greedy tokens and full-vocabulary log-probabilities at every generated position,
    teacher-forced on its own greedy tokens (or on ``forced[i]``, another run's tokens for
    prompt i); ``kv_format`` None: plain transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    scope = emulating_vllm(kv_format, decisions) if kv_format else contextlib.nullcontext()
    results = []
    with torch.no_grad(), scope:
        for ids in prompt_ids:
            tokens = list(ids)
            if forced is not None:
                tokens += forced[len(results)][:max_tokens]
            while len(tokens) < len(ids) + max_tokens:
                logits = model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
            full = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)
            generated = tokens[len(ids) :]
            results.append(
                {"token_ids": generated, "logprobs": full[len(ids) - 1 : len(tokens) - 1]}
            )
    return results
