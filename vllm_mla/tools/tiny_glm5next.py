"""The GLM-5.3-Flash (``glm5_next``, ``Glm5NextForCausalLM``) flavour of ``make-model``.

What GLM-5.3-Flash's text model is, kept: MLA of latent 512 without RoPE (qk_nope 256,
v 256, rope 0: vLLM builds ``MLAAttention`` with head size 512), q LoRA, and a kpool DSA
indexer on every MLA layer (Hadamard-128 fp8 query, pools of ``index_kpool`` keys
compressed by a learned softmax gate, ``index_kpool_compress_ape`` / ``_gate``, the
incomplete tail pool always selected).

What differs, and why:

- **Every layer is MLA** unless ``kda``: with it, GLM-5.3-Flash's own pattern (every fourth
  layer MLA, the others KDA linear attention: short convolutions, the bounded gate, the
  delta rule; 4 heads of 128 instead of 64). vLLM CPU has no KDA path; the plugin serves
  it with torch stand-ins for vLLM's Triton kernels (patches ``cpu_glm5next_kda_*``).
- **No mHC** unless ``mhc`` (``mhc: false``: vLLM's plain pre-norm residual path, the one
  it takes for GLM-5-next checkpoints without hyper-connections). With ``mhc`` the
  checkpoint has GLM-5.3-Flash's hyper-connections (``hc_mult`` streams, per layer
  ``hc_attn_*`` / ``hc_ffn_*`` mixing weights in fp32, the final unweighted mean). vLLM
  CPU's mHC ops drop the layer's RMSNorm and are ``_C``-only; the plugin serves them
  through vLLM's torch mHC with the norm applied (patches ``cpu_glm5next_mhc_*``).
- **Dense MLPs** (``mlp_layer_types`` all ``dense``): the MoE is vLLM's fused-MoE path,
  which the HY-V4 checkpoint exercises; ``n_routed_experts`` stays set because vLLM
  reads it.
- **bf16 values** in fp32 tensors: GLM-5.3-Flash is a bf16 model, and vLLM's GLM-5-next
  code assumes it (``fwht128_quant_fp8`` asserts a bf16 query; the kpool gate is a bf16
  parameter), so it is served in bf16; every weight lies on the bf16 grid, so a fp32
  reference computes with exactly the weights vLLM holds.
- ``swiglu_limit`` is far above any activation of these weights (both vLLM and
  transformers clamp there; the clamp never engages): ``tinymodel.SWIGLU_LIMIT``.

Tensors carry the checkpoint names vLLM loads (``indexer.index_kpool_compress_gate``,
``kv_a_proj_with_mqa`` without RoPE rows, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_mla.formats import LATENT

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm_mla.tools.tinymodel import TinyModelSpec

QK_NOPE = 256  # GLM-5.3-Flash's qk_nope_head_dim = v_head_dim, and no RoPE
V_HEAD = 256
KPOOL = 16  # GLM-5.3-Flash's index_kpool
# KDA (linear attention) layers: GLM-5.3-Flash's head_dim, conv width and gate bound; four
# heads (two per rank at TP 2) instead of 64
KDA_HEAD_DIM = 128
KDA_HEADS = 4
KDA_CONV = 4
KDA_LOWER_BOUND = -5.0
HC_SINKHORN_ITERS = 20  # GLM-5.3-Flash's (transformers' default)


def layer_types(spec: TinyModelSpec) -> list[str]:
    """The checkpoint's pattern with ``spec.kda``: every fourth layer (3, 7, ...) MLA, the
    others KDA (transformers' default ``layer_types``); without, every layer MLA."""
    if not spec.kda:
        return ["indexed_attention"] * spec.layers
    return ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(spec.layers)]


def config_fields(spec: TinyModelSpec) -> dict:
    """The flat (text-only) ``glm5_next`` config's own fields, on top of the fields every
    tiny DSA model has (``tinymodel.dsa_model_fields``): transformers builds ``text_config``
    from the top-level fields; ``mhc``, ``mla_use_nope``, ``indexer_rope_interleave``,
    ``topk_method`` and ``scoring_func`` are read by vLLM only (transformers always runs
    mHC: ``hc_mult`` 1 and the reference's plain residual path stand for ``mhc: false``)."""
    return {
        "architectures": ["Glm5NextForCausalLM"],
        "model_type": "glm5_next",
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "qk_nope_head_dim": QK_NOPE,
        "qk_rope_head_dim": 0,
        "v_head_dim": V_HEAD,
        "mla_use_nope": True,
        "mlp_layer_types": ["dense"] * spec.layers,
        # vLLM runs the indexer on every MLA layer (it reads no indexer_types)
        "indexer_types": ["full"] * spec.layers,
        "index_kpool": KPOOL,
        "index_kpool_always_select_tail": True,
        "indexer_rope_interleave": False,
        "layer_types": layer_types(spec),
        "linear_head_dim": KDA_HEAD_DIM,
        "linear_num_heads": KDA_HEADS,
        "linear_conv_kernel_dim": KDA_CONV,
        "linear_lower_bound": KDA_LOWER_BOUND,
        "mhc": spec.mhc,
        "hc_mult": spec.hc_mult if spec.mhc else 1,
        "hc_sinkhorn_iters": HC_SINKHORN_ITERS,
        "hc_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }


def weights(
    spec: TinyModelSpec, vocab: int, normal: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Seeded weights under GLM-5.3-Flash's checkpoint names."""
    d = spec.hidden
    out = {"model.embed_tokens.weight": normal(vocab, d)}
    for i, kind in enumerate(layer_types(spec)):
        p = f"model.layers.{i}"
        out |= _block(spec, p, normal)
        if spec.mhc:
            out |= mhc_weights(p, spec, normal)
        if kind == "linear_attention":
            out |= _kda_weights(f"{p}.self_attn", d, normal)
        else:
            out |= _mla_weights(spec, f"{p}.self_attn", normal)
    out["model.norm.weight"] = torch.ones(d)
    out["lm_head.weight"] = normal(vocab, d)
    return {name: t.to(torch.bfloat16).float() for name, t in out.items()}


def _block(spec: TinyModelSpec, p: str, normal: Callable) -> dict[str, torch.Tensor]:
    """A decoder layer's norms and dense MLP."""
    d = spec.hidden
    return {
        f"{p}.input_layernorm.weight": torch.ones(d),
        f"{p}.post_attention_layernorm.weight": torch.ones(d),
        f"{p}.mlp.gate_proj.weight": normal(spec.intermediate, d),
        f"{p}.mlp.up_proj.weight": normal(spec.intermediate, d),
        f"{p}.mlp.down_proj.weight": normal(d, spec.intermediate),
    }


def _mla_weights(spec: TinyModelSpec, a: str, normal: Callable) -> dict[str, torch.Tensor]:
    """One MLA attention (no RoPE rows) and its kpool indexer."""
    d, h, r = spec.hidden, spec.heads, spec.q_lora_rank
    n, hd = spec.index_heads, spec.index_head_dim
    ix = f"{a}.indexer"
    return {
        f"{a}.q_a_proj.weight": normal(r, d),
        f"{a}.q_a_layernorm.weight": torch.ones(r),
        f"{a}.q_b_proj.weight": normal(h * QK_NOPE, r),
        f"{a}.kv_a_proj_with_mqa.weight": normal(LATENT, d),
        f"{a}.kv_a_layernorm.weight": torch.ones(LATENT),
        f"{a}.kv_b_proj.weight": normal(h * (QK_NOPE + V_HEAD), LATENT),
        f"{a}.o_proj.weight": normal(d, h * V_HEAD),
        f"{ix}.wq_b.weight": normal(n * hd, r),
        f"{ix}.wk.weight": normal(hd, d),
        f"{ix}.k_norm.weight": torch.ones(hd),
        f"{ix}.k_norm.bias": torch.zeros(hd),
        f"{ix}.weights_proj.weight": normal(n, d),
        f"{ix}.index_kpool_compress_ape": normal(KPOOL, hd),
        f"{ix}.index_kpool_compress_gate": normal(hd, d),
    }


def _kda_weights(a: str, d: int, normal: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """One KDA layer under the checkpoint's names (vLLM merges q/k/v/b/f_a/g_a into one
    GEMM and keeps the three short convolutions apart; transformers renames the gate's
    tensors under ``forget_gate`` and concatenates the convolutions)."""
    width = KDA_HEADS * KDA_HEAD_DIM
    out = {f"{a}.{name}.weight": normal(width, d) for name in ("q_proj", "k_proj", "v_proj")}
    out |= {f"{a}.{name}_conv1d.weight": normal(width, 1, KDA_CONV) for name in "qkv"}
    return out | {
        f"{a}.b_proj.weight": normal(KDA_HEADS, d),
        f"{a}.f_a_proj.weight": normal(KDA_HEAD_DIM, d),
        f"{a}.f_b_proj.weight": normal(width, KDA_HEAD_DIM),
        f"{a}.g_a_proj.weight": normal(KDA_HEAD_DIM, d),
        f"{a}.g_b_proj.weight": normal(width, KDA_HEAD_DIM),
        f"{a}.dt_bias": normal(width),
        f"{a}.A_log": normal(KDA_HEADS),
        f"{a}.o_norm.weight": torch.ones(KDA_HEAD_DIM),
        f"{a}.o_proj.weight": normal(d, width),
    }


def mhc_weights(p: str, spec: TinyModelSpec, normal: Callable) -> dict[str, torch.Tensor]:
    """One layer's hyper-connection weights under vLLM's (and DeepSeek-V4's) names
    (transformers renames them ``attn_hc.fn`` ...): the mixing projection scaled so its
    logits are O(1) on the normalized streams, biases O(1), scales near 1."""
    n, width = spec.hc_mult, spec.hc_mult * spec.hidden
    mix = (2 + n) * n
    out = {}
    for block in ("attn", "ffn"):
        out[f"{p}.hc_{block}_fn"] = normal(mix, width) / (spec.init_std * width**0.5)
        out[f"{p}.hc_{block}_base"] = normal(mix) / spec.init_std
        out[f"{p}.hc_{block}_scale"] = 1 + normal(3)
    return out
