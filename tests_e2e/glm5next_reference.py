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
- **Weights** are loaded by name from the checkpoint (the text model under ``model.``,
  ``lm_head`` applied by hand): transformers' multimodal class would build a vision tower
  this checkpoint does not have.

Not emulated, on purpose: vLLM's bf16 activations (the engine serves the model in bf16, as
vLLM's GLM-5-next code requires; the tolerance in the test says what they cost), and the
indexer's fp8 scoring: the tests use ``index_topk`` >= every context they reach, so every
pool is selected and the tail always is.

``latent_noise`` perturbs the latent by bf16-sized noise before its rounding: with
``fp8_ds_mla`` records that moves a few percent of the e4m3 elements to their other
neighbour, as the bf16 engine's own latent does (the fp8 test's error model).

``tail="dropped"`` turns ``index_kpool_always_select_tail`` off: the last incomplete pool
is no longer attended, to show the engine and this reference both select it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from dsa_reference import latent_through, replaced, round_kv_c
from safetensors.torch import load_file

TAILS = ("selected", "dropped")


def _plain_residual_forward(
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
    """vLLM's non-mHC decoder layer on transformers' one-stream ``[B, S, 1, D]`` state."""
    x = hidden_states[:, :, 0]
    attn, _, topk = self.self_attn(
        hidden_states=self.input_layernorm(x),
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=None,
        prev_topk_indices=prev_topk_indices,
        **kwargs,
    )
    x = x + attn
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x[:, :, None], topk


# bf16's unit roundoff: the relative size of the engine's activation noise
BF16_NOISE = 2.0**-8


@contextlib.contextmanager
def emulating_vllm(kv_format: str | None, latent_noise: int | None = None) -> Iterator[None]:
    """Patch transformers' GLM-5-next as the module docstring says (``kv_format`` None: no
    KV rounding). ``latent_noise``: a seed; the latent is perturbed by ``BF16_NOISE``
    relative Gaussian noise before its rounding (what the bf16 engine's latent differs
    by), so the rounding lands on the other neighbour where the engine's may."""
    from transformers.models.glm5_next import modeling_glm5_next as m

    original_attention = m.Glm5NextTextAttention.forward
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

    with (
        replaced(m.Glm5NextTextDecoderLayer, forward=_plain_residual_forward),
        replaced(m.Glm5NextTextAttention, forward=attention_forward),
    ):
        yield


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
    assert config.hc_mult == 1 and not config.mhc  # the plain-residual premise above
    model = Glm5NextTextModel(config).float().eval()
    tensors = load_file(str(Path(model_dir) / "model.safetensors"))
    lm_head = tensors.pop("lm_head.weight")
    state = {name.removeprefix("model."): t for name, t in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all("_hc." in name for name in missing), missing
    return model, lm_head


def reference(
    model_dir: Path,
    prompt_ids: list[list[int]],
    max_tokens: int,
    kv_format: str | None,
    tail: str = "selected",
    latent_noise: int | None = None,
) -> list[dict]:
    """Greedy tokens and full-vocabulary log-probabilities at every generated position,
    teacher-forced on its own greedy tokens (each a whole-prefix forward, no cache)."""
    model, lm_head = load(model_dir, tail)

    def logits(tokens: list[int]) -> torch.Tensor:
        hidden = model(torch.tensor([tokens]), use_cache=False).last_hidden_state[0]
        return hidden @ lm_head.t()

    results = []
    with torch.no_grad(), emulating_vllm(kv_format, latent_noise):
        for ids in prompt_ids:
            tokens = list(ids)
            for _ in range(max_tokens):
                tokens.append(int(logits(tokens)[-1].argmax()))
            full = torch.log_softmax(logits(tokens).double(), -1)
            results.append(
                {"token_ids": tokens[len(ids) :], "logprobs": full[len(ids) - 1 : len(tokens) - 1]}
            )
    return results
