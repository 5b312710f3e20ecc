"""The fp32 reference for the GLM-5.3-Flash end-to-end runs: transformers' own
``Glm5NextTextModel`` layers (its MLA without RoPE, its kpool indexer with the tail pool,
eager attention over the indexer's top-k mask), made to compute what vLLM computes where
the two legitimately differ.

- **No mHC**: the checkpoint says ``mhc: false`` (``tiny_glm5next`` says why), which vLLM
  serves with a plain pre-norm residual (``Glm5NextDecoderLayer.forward``'s non-mHC
  branch: ``input_layernorm``, attention, residual add, ``post_attention_layernorm``, MLP,
  residual add; the final ``norm``). transformers always runs hyper-connections; with
  ``hc_mult`` 1 its one stream is this residual once each decoder layer's forward is that
  branch (patched below) and ``hc_head``'s mean over one stream is the identity.
- **Latent KV**: ``kv_a_layernorm``'s output passes through the KV cache's record format
  (bf16 records, or ``fp8_ds_mla``'s e4m3 + per-128 scales), the functions
  ``dsa_reference`` uses; there is no RoPE part to round.
- **KDA layers** (a checkpoint made with ``kda``): transformers' own linear attention
  (short convolutions, the bounded gate, its chunked delta rule in fp32) on the
  checkpoint's tensors under transformers' names (``_kda_renamed``), with vLLM's output
  norm eps; each prefix runs whole (no recurrent cache), as every step is teacher-forced.
- **Weights** are loaded by name from the checkpoint (the text model under ``model.``,
  ``lm_head`` applied by hand): transformers' multimodal class would build a vision tower
  this checkpoint does not have.

- **Selection** (``kpool_topk``): vLLM's kpool indexer arithmetic on transformers'
  projections, rounded to bf16 where the engine's GEMMs write bf16 (query, key, gate; the
  head weights are fp32 in vLLM too), then ``vllm_mla.ops.kpool_indexer.reference``: the
  functions the plugin serves the CPU engine with.

Not emulated, on purpose: vLLM's bf16 activations elsewhere (the engine serves the model in
bf16, as vLLM's GLM-5-next code requires; the test's error model measures what they cost).

``latent_noise`` perturbs the latent, the indexer's inputs and each KDA layer's output
(where the engine's bf16 store rounds it) by bf16-sized noise: with
``fp8_ds_mla`` records that moves a few percent of the e4m3 elements to their other
neighbour, and near-tied pools to the other side, as the bf16 engine's own values do (the
test's error model).

``tail="dropped"`` turns ``index_kpool_always_select_tail`` off: the last incomplete pool
is no longer attended, to show the engine and this reference both select it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from dsa_reference import Decisions, latent_through, replaced, round_kv_c
from safetensors.torch import load_file

from vllm_mla.ops.kpool_indexer import reference as kp

TAILS = ("selected", "dropped")


def _decoder_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values: object | None = None,
    use_cache: bool | None = False,
    position_embeddings: object | None = None,
    prev_topk_indices: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's decoder layer on transformers' ``[B, S, N, D]`` streams: with one stream its
    non-mHC residual, with N its mHC (transformers' hyper-connection weights, the streams
    mixed by ``post`` / ``comb``); the streams, the norms' outputs, each block's output and
    the MLP's GEMM outputs rounded to bf16 where the bf16 engine stores them."""
    mhc = hidden_states.shape[2] > 1
    if mhc:
        post, comb, block_input = self.attn_hc(hidden_states)
    else:
        block_input = hidden_states[:, :, 0]
    normed = _bf16(self.input_layernorm(_bf16(block_input)))
    topk = None
    if self.block_type == "linear_attention":  # KDA: no top-k, no cache (whole prefixes)
        attn = self.self_attn(hidden_states=normed, attention_mask=attention_mask, **kwargs)
    else:
        attn, _, topk = self.self_attn(
            hidden_states=normed,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=None,
            prev_topk_indices=prev_topk_indices,
            **kwargs,
        )
    if not mhc:
        x = _bf16(block_input + _bf16(attn))
        x = _bf16(x + _bf16_mlp(self.mlp, _bf16(self.post_attention_layernorm(x))))
        return x[:, :, None], topk
    streams = _bf16(_hc_post(_bf16(attn), hidden_states, post, comb))
    post, comb, block_input = self.ffn_hc(streams)
    mlp = _bf16_mlp(self.mlp, _bf16(self.post_attention_layernorm(_bf16(block_input))))
    return _bf16(_hc_post(mlp, streams, post, comb)), topk


def _hc_post(out: torch.Tensor, streams: torch.Tensor, post, comb) -> torch.Tensor:
    """transformers' mHC expansion: ``post_j * out + sum_i comb_ij * stream_i``."""
    return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)


def _bf16_mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' dense MLP with vLLM's bf16 stores: the gate/up GEMM, SiLU-and-mul and
    the down GEMM outputs (the SwiGLU clamp never engages: ``tinymodel.SWIGLU_LIMIT``)."""
    return _bf16(mlp.down_proj(_bf16(mlp.act_fn(_bf16(mlp.gate_proj(x))) * _bf16(mlp.up_proj(x)))))


# bf16's unit roundoff: the relative size of the engine's activation noise
BF16_NOISE = 2.0**-8


def kpool_topk(
    indexer: torch.nn.Module,
    hidden_states: torch.Tensor,
    q_resid: torch.Tensor,
    decisions: Decisions,
    gen: torch.Generator | None = None,
) -> torch.Tensor:
    """vLLM's kpool selection (``vllm_mla.ops.kpool_indexer.reference``, what the plugin
    serves the CPU engine with) from transformers' indexer projections: the query, key and
    gate rounded to bf16 where the bf16 engine's GEMMs write them (the head weights stay
    fp32, as vLLM computes them), then the
    Hadamard rotation, e4m3 queries and pool keys (ue8m0 scales), pool logits, the top
    ``index_topk // kpool`` pools (``decisions`` may override them) and the tail.
    ``gen``: each input perturbed by ``BF16_NOISE`` relative noise first (what the bf16
    engine's own inputs to the indexer differ by). int32 ``[B, S, width]``, -1 padded."""

    def noisy(x: torch.Tensor) -> torch.Tensor:
        if gen is None:
            return x
        return x * (1 + BF16_NOISE * torch.randn(x.shape, generator=gen))

    batch, seq = hidden_states.shape[:2]
    kpool, topk = indexer.index_kpool, indexer.index_topk
    bf16 = torch.bfloat16
    q = noisy(indexer.wq_b(q_resid)).view(batch, seq, -1, indexer.head_dim).to(bf16)
    # vLLM: the wk GEMM writes bf16, its LayerNorm runs in fp32 and casts back
    k = indexer.k_norm(noisy(indexer.wk(hidden_states)).to(bf16).float()).to(bf16)
    gate = noisy(F.linear(hidden_states, indexer.index_kpool_compress_gate)).to(bf16)
    weights = noisy(indexer.weights_proj(hidden_states))  # vLLM: fp32 (its _wp_fp32)
    ape = indexer.index_kpool_compress_ape.float()
    lengths = torch.arange(1, seq + 1)
    out = []
    for b in range(batch):
        qv, q_scale = kp.quantize_query(q[b])
        pools, pool_scale = kp.quantize_pools(kp.request_pools(k[b], gate[b], ape))
        scores = kp.logits(qv.float(), kp.fold_weights(weights[b], q_scale), pools, pool_scale)
        picked = kp.select_pools(scores, lengths // kpool, topk // kpool)
        picked = decisions.selected(indexer.layer_idx, scores, picked)
        rows = kp.expand_pools_and_tail(picked, lengths, kpool)
        if not indexer.index_kpool_always_select_tail:
            rows[:, topk:] = -1
        out.append(rows)
    return torch.stack(out)


@contextlib.contextmanager
def emulating_vllm(
    kv_format: str | None,
    latent_noise: int | None = None,
    emulate_indexer: bool = True,
    decisions: Decisions | None = None,
) -> Iterator[None]:
    """Patch transformers' GLM-5-next as the module docstring says (``kv_format`` None: no
    KV rounding). ``latent_noise``: a seed; the latent (before its rounding) and the
    indexer's inputs are perturbed by ``BF16_NOISE`` relative Gaussian noise (what the
    bf16 engine's differ by), so roundings and pool selections land where the engine's
    may.
    ``emulate_indexer`` False: transformers' own fp32 pool scores select."""
    from transformers.models.glm5_next import modeling_glm5_next as m

    decisions = decisions or Decisions()
    original_attention = m.Glm5NextTextAttention.forward
    original_indexer = m.Glm5NextTextIndexer.forward

    def indexer_forward(self, hidden_states, q_resid, *args, **kwargs):
        if not emulate_indexer:
            return original_indexer(self, hidden_states, q_resid, *args, **kwargs)
        return kpool_topk(self, hidden_states, q_resid, decisions, gen)

    gen = None if latent_noise is None else torch.Generator().manual_seed(latent_noise)

    def cached(x: torch.Tensor) -> torch.Tensor:
        if gen is not None:
            x = x * (1 + BF16_NOISE * torch.randn(x.shape, generator=gen))
        return round_kv_c(x, kv_format)

    def attention_forward(self, *args, **kwargs):
        if kv_format is None:
            return original_attention(self, *args, **kwargs)
        with latent_through(self, cached):
            return original_attention(self, *args, **kwargs)

    original_kda = m.Glm5NextTextLinearAttention.forward

    def kda_forward(self, hidden_states, *args, **kwargs):
        stores = [getattr(self, name) for name in _KDA_BF16_STORES]
        stores += [getattr(self.forget_gate, name) for name in ("f_a_proj", "f_b_proj")]
        hooks = [module.register_forward_hook(_bf16_output) for module in stores]
        try:
            out = original_kda(self, _bf16(hidden_states), *args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
        if gen is None:
            return out
        return out * (1 + BF16_NOISE * torch.randn(out.shape, generator=gen))

    with (
        replaced(m.Glm5NextTextDecoderLayer, forward=_decoder_forward),
        replaced(m.Glm5NextTextHyperHead, forward=_hc_mean),
        replaced(m.Glm5NextTextAttention, forward=attention_forward),
        replaced(m.Glm5NextTextIndexer, forward=indexer_forward),
        replaced(m.Glm5NextTextLinearAttention, forward=kda_forward),
        replaced(
            m,
            causal_conv1d_fn=_bf16_result(m.causal_conv1d_fn),
            chunk_kimi_delta_attention=_bf16_result(m.chunk_kimi_delta_attention),
        ),
    ):
        yield


# Where vLLM's KDA layer stores bf16 (glm5next/common/kda.py): the merged q/k/v/b/f_a/g_a
# GEMM, f_b and g_b, the short convolution, the recurrence's output, the gated norm and
# o_proj; the gate, beta's sigmoid and the recurrence itself run in fp32 on those values.
_KDA_BF16_STORES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "b_proj",
    "g_a_proj",
    "g_b_proj",
    "o_norm",
    "o_proj",
)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _hc_mean(self, streams: torch.Tensor) -> torch.Tensor:
    """The final stream collapse (vLLM's ``hc_contract``: a bf16 mean)."""
    return _bf16(streams.mean(dim=2))


def _bf16_output(module, inputs, output):
    return _bf16(output)


def _bf16_result(fn):
    """``fn`` with its (first) tensor result rounded to bf16."""

    def rounded(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, tuple):
            return (_bf16(out[0]), *out[1:])
        return _bf16(out)

    return rounded


def load(model_dir: Path, tail: str = "selected") -> tuple[torch.nn.Module, torch.Tensor]:
    """(transformers' ``Glm5NextTextModel`` in fp32, eager attention, the checkpoint's
    weights; the ``lm_head`` weight). Every tensor of the checkpoint is used and every
    parameter but the unused hyper-connection ones is loaded (asserted)."""
    from transformers import AutoConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    config = AutoConfig.from_pretrained(model_dir).text_config
    config._attn_implementation = "eager"
    config.index_kpool_always_select_tail = tail == "selected"
    assert (config.hc_mult > 1) == bool(config.mhc)  # one stream is vLLM's non-mHC path
    model = Glm5NextTextModel(config).float().eval()
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    lm_head = tensors.pop("lm_head.weight")
    state = _renamed({name.removeprefix("model."): t for name, t in tensors.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert config.mhc or all("_hc." in name for name in missing), missing
    assert not config.mhc or not missing, missing
    for layer in model.layers:
        if layer.block_type == "linear_attention":
            layer.self_attn.o_norm.variance_epsilon = KDA_O_NORM_EPS
    return model, lm_head


# vLLM builds the KDA output norm with FusedRMSNormGated's default eps (glm5next/common/
# kda.py: no eps passed); transformers takes rms_norm_eps (1e-6)
KDA_O_NORM_EPS = 1e-5
_FORGET_GATE = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")


def _renamed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors under transformers' names, as its ``conversion_mapping`` for glm5_next
    renames them: the KDA gate's under ``forget_gate.``, the KDA q/k/v short convolutions
    concatenated into one ``conv1d``, the mHC weights ``hc_attn_fn`` -> ``attn_hc.fn``."""
    out = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition("self_attn.")
        layer, _, hc = name.rpartition(".hc_")
        if leaf in _FORGET_GATE:
            out[f"{prefix}self_attn.forget_gate.{leaf}"] = t
        elif leaf == "q_conv1d.weight":
            convs = [state[f"{prefix}self_attn.{c}_conv1d.weight"] for c in "qkv"]
            out[f"{prefix}self_attn.conv1d.weight"] = torch.cat(convs)
        elif layer and hc.split("_")[0] in ("attn", "ffn"):
            block, _, field = hc.partition("_")
            out[f"{layer}.{block}_hc.{field}"] = t
        elif leaf not in ("k_conv1d.weight", "v_conv1d.weight"):
            out[name] = t
    return out


def reference(
    model_dir: Path,
    prompt_ids: list[list[int]],
    max_tokens: int,
    kv_format: str | None,
    tail: str = "selected",
    latent_noise: int | None = None,
    emulate_indexer: bool = True,
    decisions: Decisions | None = None,
    forced: list[list[int]] | None = None,
) -> list[dict]:
    """Greedy tokens and full-vocabulary log-probabilities at every generated position,
    teacher-forced on its own greedy tokens (or on ``forced[i]``, another run's tokens for
    prompt i; each a whole-prefix forward, no cache)."""
    model, lm_head = load(model_dir, tail)

    def logits(tokens: list[int]) -> torch.Tensor:
        hidden = model(torch.tensor([tokens]), use_cache=False).last_hidden_state[0]
        return _bf16(_bf16(hidden) @ lm_head.t())  # vLLM's bf16 final norm and logits

    results = []
    with torch.no_grad(), emulating_vllm(kv_format, latent_noise, emulate_indexer, decisions):
        for ids in prompt_ids:
            tokens = list(ids)
            if forced is not None:  # another run's tokens for this prompt
                tokens += forced[len(results)][:max_tokens]
            while len(tokens) < len(ids) + max_tokens:
                tokens.append(int(logits(tokens)[-1].argmax()))
            full = torch.log_softmax(logits(tokens).double(), -1)
            results.append(
                {"token_ids": tokens[len(ids) :], "logprobs": full[len(ids) - 1 : len(tokens) - 1]}
            )
    return results
