"""The DeepSeek-V4 (``deepseek_v4``, ``DeepseekV4ForCausalLM``) flavour of ``make-model``.

What DeepSeek-V4's text model is, kept:

- **Attention** of head dimension 512 (448 NoPE + 64 interleaved RoPE), one latent that is
  both K and V (``wkv``, ``kv_norm``), q LoRA (``wq_a``, ``q_norm``, ``wq_b``), a learnable
  per-head sink (``attn_sink``, drawn around ``sink_logit`` so it changes the output), the
  grouped output projection (``wo_a`` over ``O_GROUPS`` head groups, then ``wo_b``).
- **Every layer kind**, in ``compress_ratios``: layer 0 attends to its sliding window only;
  then C4 layers (a 4:1 compressor over overlapping windows, ``coff`` 2, plus the indexer
  with its own compressor choosing ``index_topk`` compressed entries) alternate with C128
  layers (a 128:1 compressor, every entry attended). vLLM needs a C4 layer wherever a C128
  layer is (its KV page sizes unify only so), which this pattern always has.
- **mHC** over ``hc_mult`` streams (``hc_attn_*`` / ``hc_ffn_*`` per layer, ``hc_head_*``
  at the end) and **MoE** on every layer: ``num_hash_layers`` hash-routed layers first
  (``gate.tid2eid``: each token id's experts), then score-routed ones (``gate.bias``), each
  with one shared expert; ``sqrtsoftplus`` scores, renormalized, times 1.5.

What differs, and why:

- **Sizes**: every dimension small except those vLLM fixes (head 512, RoPE 64, indexer head
  128). The expert defaults (64 routed, 6 per token) are the smallest vLLM CPU's ``_C``
  router kernels are built for (``hash_topk_cpu`` / ``biased_topk_cpu`` instances), so the
  same checkpoint also runs on vLLM CPU's own V4 path.
- **bf16 values, no quantization**: DeepSeek-V4 ships FP8 block linears and MXFP4 experts,
  which vLLM CPU serves only with AMX; every weight here lies on the bf16 grid in fp32
  tensors, so a fp32 reference computes with exactly the weights vLLM holds.
- ``swiglu_limit`` is far above any activation (``tinymodel.SWIGLU_LIMIT``): vLLM CPU's bf16
  routed experts do not clamp, transformers does; here the clamp never engages.
- **No MTP layer** (vLLM CPU has no V4 MTP) and no YaRN (``rope_scaling`` left out: plain
  RoPE at ``rope_theta`` on window-only layers, ``compress_rope_theta`` on the others).

Tensors carry DeepSeek-V4's original checkpoint names (``layers.{i}.attn.wq_a.weight``,
``embed.weight``, ``head.weight``, ``layers.{i}.ffn.experts.{e}.w1.weight`` ...), which vLLM
loads as they are and transformers renames on load (its ``conversion_mapping``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_mla.tools import tiny_glm5next

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm_mla.tools.tinymodel import TinyModelSpec

HEAD_DIM = 512  # DeepSeek-V4's: 448 NoPE + 64 RoPE, one latent for K and V
ROPE_DIM = 64
INDEX_HEAD_DIM = 128
C4, C128 = 4, 128  # the compress ratios of the indexed and the heavily compressed layers
O_GROUPS = 2  # head groups of the grouped output projection (DeepSeek-V4: 8 of 64 heads)
O_LORA_RANK = 64  # per group; vLLM CPU's grouped GEMM needs a multiple of 32
HASH_LAYERS = 1  # hash-routed MoE layers first (DeepSeek-V4: 3)
DEFAULT_EXPERTS = 64  # the fewest vLLM CPU's _C routers are built for
DEFAULT_EXPERTS_PER_TOK = 6
ROUTED_SCALING = 1.5  # DeepSeek-V4's
ROPE_THETA = 10000.0
COMPRESS_ROPE_THETA = 160000.0
HC_SINKHORN_ITERS = 20


def compress_ratios(layers: int) -> list[int]:
    """Layer 0 window-only, then C4 and C128 alternating (a C4 before every C128)."""
    return [0] + [C4 if i % 2 else C128 for i in range(1, layers)]


def config_fields(spec: TinyModelSpec) -> dict:
    """The ``deepseek_v4`` config under DeepSeek-V4's own keys (``compress_ratios``,
    ``num_hash_layers``, ``sliding_window``, ...): what vLLM reads, and what transformers
    turns into its ``layer_types`` / ``mlp_layer_types``."""
    from vllm_mla.tools.tinymodel import SWIGLU_LIMIT

    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "hidden_size": spec.hidden,
        "moe_intermediate_size": moe_intermediate(spec),
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": ROPE_DIM,
        "q_lora_rank": spec.q_lora_rank,
        "o_groups": O_GROUPS,
        "o_lora_rank": O_LORA_RANK,
        "n_routed_experts": spec.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": spec.experts_per_tok,
        "num_hash_layers": HASH_LAYERS,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": ROUTED_SCALING,
        "swiglu_limit": SWIGLU_LIMIT,
        "hidden_act": "silu",
        "compress_ratios": compress_ratios(spec.layers),
        "compress_rope_theta": COMPRESS_ROPE_THETA,
        "rope_theta": ROPE_THETA,
        "sliding_window": spec.window,
        "index_n_heads": spec.index_heads,
        "index_head_dim": INDEX_HEAD_DIM,
        "index_topk": spec.index_topk,
        "hc_mult": spec.hc_mult,
        "hc_sinkhorn_iters": HC_SINKHORN_ITERS,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": spec.max_position,
        "num_nextn_predict_layers": 0,
        "initializer_range": spec.init_std,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def moe_intermediate(spec: TinyModelSpec) -> int:
    """Each expert's (and the shared expert's) intermediate width."""
    return spec.intermediate // 4


def weights(
    spec: TinyModelSpec, vocab: int, gen: torch.Generator, normal: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Seeded weights under DeepSeek-V4's checkpoint names, floats on the bf16 grid."""
    d, hc = spec.hidden, spec.hc_mult
    out = {"embed.weight": normal(vocab, d)}
    for i, ratio in enumerate(compress_ratios(spec.layers)):
        p = f"layers.{i}"
        out |= {f"{p}.attn_norm.weight": torch.ones(d), f"{p}.ffn_norm.weight": torch.ones(d)}
        out |= tiny_glm5next.mhc_weights(p, spec, normal)
        out |= _attention(spec, f"{p}.attn", ratio, gen, normal)
        out |= _moe(spec, f"{p}.ffn", vocab, i < HASH_LAYERS, gen, normal)
    width = hc * d
    out |= {
        "hc_head_fn": normal(hc, width) / (spec.init_std * width**0.5),
        "hc_head_base": normal(hc) / spec.init_std,
        "hc_head_scale": 1 + normal(1),
        "norm.weight": torch.ones(d),
        "head.weight": normal(vocab, d),
    }
    return {n: t.to(torch.bfloat16).float() if t.is_floating_point() else t for n, t in out.items()}


def _attention(
    spec: TinyModelSpec, a: str, ratio: int, gen: torch.Generator, normal: Callable
) -> dict[str, torch.Tensor]:
    """One layer's attention: q LoRA, the shared latent, the sink, the grouped output, and
    for ``ratio`` > 0 its compressor (and, at C4, the indexer)."""
    d, h, r = spec.hidden, spec.heads, spec.q_lora_rank
    out = {
        f"{a}.wq_a.weight": normal(r, d),
        f"{a}.q_norm.weight": torch.ones(r),
        f"{a}.wq_b.weight": normal(h * HEAD_DIM, r),
        f"{a}.wkv.weight": normal(HEAD_DIM, d),
        f"{a}.kv_norm.weight": torch.ones(HEAD_DIM),
        f"{a}.wo_a.weight": normal(O_GROUPS * O_LORA_RANK, h * HEAD_DIM // O_GROUPS),
        f"{a}.wo_b.weight": normal(d, O_GROUPS * O_LORA_RANK),
        f"{a}.attn_sink": spec.sink_logit + torch.randn(h, generator=gen),
    }
    if not ratio:
        return out
    out |= _compressor(f"{a}.compressor", d, ratio, HEAD_DIM, normal)
    if ratio == C4:
        ix = f"{a}.indexer"
        out |= {
            f"{ix}.wq_b.weight": normal(spec.index_heads * INDEX_HEAD_DIM, r),
            f"{ix}.weights_proj.weight": normal(spec.index_heads, d),
        }
        out |= _compressor(f"{ix}.compressor", d, ratio, INDEX_HEAD_DIM, normal)
    return out


def _compressor(c: str, d: int, ratio: int, width: int, normal: Callable) -> dict:
    """A compressor: values and gate logits per token, a learned position bias per window
    slot, the entry's norm. C4's windows overlap (two halves per token: ``coff`` 2)."""
    coff = 2 if ratio == C4 else 1
    return {
        f"{c}.wkv.weight": normal(coff * width, d),
        f"{c}.wgate.weight": normal(coff * width, d),
        f"{c}.ape": normal(ratio, coff * width),
        f"{c}.norm.weight": torch.ones(width),
    }


def _moe(
    spec: TinyModelSpec, f: str, vocab: int, hashed: bool, gen: torch.Generator, normal: Callable
) -> dict[str, torch.Tensor]:
    """One MoE block: the router (hash table or score bias), the routed experts one by one
    (``w1`` gate, ``w3`` up, ``w2`` down) and the shared expert."""
    d, e, k, m = spec.hidden, spec.experts, spec.experts_per_tok, moe_intermediate(spec)
    out = {f"{f}.gate.weight": normal(e, d)}
    if hashed:  # each token id's k distinct experts
        rows = [torch.randperm(e, generator=gen)[:k] for _ in range(vocab)]
        out[f"{f}.gate.tid2eid"] = torch.stack(rows).to(torch.int32)
    else:
        out[f"{f}.gate.bias"] = 0.1 * torch.randn(e, generator=gen)
    for name in (*(f"experts.{j}" for j in range(e)), "shared_experts"):
        out |= {
            f"{f}.{name}.w1.weight": normal(m, d),
            f"{f}.{name}.w2.weight": normal(d, m),
            f"{f}.{name}.w3.weight": normal(m, d),
        }
    return out
