"""The fp32 reference for the HY-V4 end-to-end runs: transformers' own ``HYV4ForCausalLM``
(eager attention, learnable sink included), made to compute what vLLM computes where the
two legitimately differ.

- **RoPE layout**: transformers 5.19's HY-V4 applies rotate-half (NeoX) RoPE to the rope
  slices of the MLA query / key and of the indexer's query / key; vLLM 0.32's HY-V4 builds
  both rotary embeddings with ``is_neox_style=False`` (interleaved pairs; its comment: the
  checkpoint stores q_pe / k_pe in the interleaved Megatron layout). The same checkpoint
  therefore gives different models; ``rope="interleaved"`` (the default) computes vLLM's,
  ``rope="half"`` transformers' own.
- **Latent KV**: ``kv_a_layernorm``'s output and the roped ``k_pe`` pass through the KV
  cache's record format (bf16 records, or ``fp8_ds_mla``'s e4m3 + per-128 scales and bf16
  k_pe), the same functions ``dsa_reference`` uses.

Not emulated, on purpose: the indexer's fp8 query / key quantization. The tests use
``index_topk`` >= every context they reach, so every causal token is selected whatever the
scores are (transformers keeps ``min(index_topk, T)`` per query, vLLM every token of a context
no longer than top-k), and no test outcome depends on the indexer's near-ties.

``sink="none"`` drops the learnable sink (its logits set to -inf: no term in any
denominator), to show the engine and this reference both include it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from dsa_reference import Decisions, latent_through, replaced, round_k_pe, round_kv_c, vllm_topk

ROPES = ("interleaved", "half")


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """vLLM's ``is_neox_style=False`` rotary embedding: pairs ``(x[2i], x[2i+1])`` rotated by
    frequency ``i``. ``cos`` / ``sin`` are transformers' ``cat(freqs, freqs)`` tables."""
    half = x.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * cos + rotated * sin


@contextlib.contextmanager
def emulating_vllm(
    kv_format: str | None,
    rope: str = "interleaved",
    emulate_indexer: bool = True,
    decisions: Decisions | None = None,
) -> Iterator[None]:
    """Patch transformers' HY-V4 as described in the module docstring (``kv_format`` None:
    no KV rounding)."""
    if rope not in ROPES:
        raise ValueError(f"rope must be one of {ROPES}, got {rope!r}")
    from transformers.models.hy_v4 import modeling_hy_v4 as m

    original_rope = m.apply_rotary_pos_emb
    original_attention = m.HYV4Attention.forward
    original_indexer = m.HYV4Indexer.forward
    in_indexer = [False]

    def patched_rope(q, k, cos, sin, unsqueeze_dim=1):
        if rope == "half":
            q, k = original_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        else:
            cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
            q, k = rotate_interleaved(q, cos, sin), rotate_interleaved(k, cos, sin)
        if kv_format is not None and not in_indexer[0]:
            k = round_k_pe(k, kv_format)  # the MLA k_pe, as the cache gives it back
        return q, k

    def indexer_forward(self, hidden_states, q_resid, position_embeddings, *args, **kwargs):
        if not emulate_indexer:
            in_indexer[0] = True
            try:
                return original_indexer(
                    self, hidden_states, q_resid, position_embeddings, *args, **kwargs
                )
            finally:
                in_indexer[0] = False
        # transformers' projections, fp32 LayerNorm and RoPE (on the last rope dims), then
        # vLLM's quantized scoring and selection
        batch, seq, _ = hidden_states.shape
        split = [self.head_dim - self.qk_rope_head_dim, self.qk_rope_head_dim]
        q = self.wq_b(q_resid).view(batch, seq, self.n_heads, self.head_dim)
        q_pass, q_rot = torch.split(q, split, -1)
        k = self.k_norm(self.wk(hidden_states).float()).unsqueeze(2)
        k_pass, k_rot = torch.split(k, split, -1)
        in_indexer[0] = True
        try:
            cos, sin = position_embeddings
            q_rot, k_rot = m.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        finally:
            in_indexer[0] = False
        q = torch.cat([q_pass, q_rot], -1)
        k = torch.cat([k_pass, k_rot], -1).squeeze(2)
        weights = self.weights_proj(hidden_states).float() * self.softmax_scale
        return vllm_topk(q, k, weights, self.index_topk, self.layer_idx, decisions)

    def attention_forward(self, *args, **kwargs):
        if kv_format is None:
            return original_attention(self, *args, **kwargs)
        with latent_through(self, lambda x: round_kv_c(x, kv_format)):
            return original_attention(self, *args, **kwargs)

    with (
        replaced(m, apply_rotary_pos_emb=patched_rope),
        replaced(m.HYV4Attention, forward=attention_forward),
        replaced(m.HYV4Indexer, forward=indexer_forward),
    ):
        yield


def load(model_dir, sink: str = "model"):
    """transformers' HYV4ForCausalLM in fp32, eager attention (the only one that applies
    the sink); ``sink="none"``: every layer's sink logits -inf."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    if sink == "none":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(float("-inf"))
    elif sink != "model":
        raise ValueError(f"sink must be 'model' or 'none', got {sink!r}")
    return model


def reference(
    model_dir,
    prompt_ids: list[list[int]],
    max_tokens: int,
    kv_format: str | None,
    rope: str = "interleaved",
    sink: str = "model",
    emulate_indexer: bool = True,
    decisions: Decisions | None = None,
) -> list[dict]:
    """Greedy tokens and full-vocabulary log-probabilities at every generated position,
    teacher-forced on its own greedy tokens (each a whole-prefix forward, no cache)."""
    model = load(model_dir, sink)
    results = []
    with torch.no_grad(), emulating_vllm(kv_format, rope, emulate_indexer, decisions):
        for ids in prompt_ids:
            tokens = list(ids)
            for _ in range(max_tokens):
                logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
                tokens.append(int(logits.argmax()))
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0]
            full = torch.log_softmax(logits.double(), -1)
            results.append(
                {
                    "token_ids": tokens[len(ids) :],
                    "logprobs": full[len(ids) - 1 : len(tokens) - 1],
                }
            )
    return results
