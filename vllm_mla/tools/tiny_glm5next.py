"""The GLM-5.3-Flash (``glm5_next``, ``Glm5NextForCausalLM``) flavour of ``make-model``.

What GLM-5.3-Flash's text model is, kept: MLA of latent 512 without RoPE (qk_nope 256,
v 256, rope 0: vLLM builds ``MLAAttention`` with head size 512), q LoRA, and a kpool DSA
indexer on every MLA layer (Hadamard-128 fp8 query, pools of ``index_kpool`` keys
compressed by a learned softmax gate, ``index_kpool_compress_ape`` / ``_gate``, the
incomplete tail pool always selected).

What differs, and why:

- **Every layer is MLA** (``layer_types`` all ``indexed_attention``). The real model
  interleaves KDA linear-attention layers, which vLLM CPU cannot run (its
  ``gather_initial_states`` asserts CUDA / XPU and the chunk kernels are Triton); the
  layers this plugin serves are the MLA ones.
- **No mHC** (``mhc: false``: vLLM's plain pre-norm residual path, the one it takes for
  GLM-5-next checkpoints without hyper-connections). vLLM CPU 0.32's mHC ops
  (``MHCPreOp`` / ``MHCFusedPostPreOp``: ``forward_cpu`` and ``forward_native``) accept
  bf16 activations only and ignore the ``norm_weight`` the decoder layer passes them,
  dropping the layer's input RMSNorm, so an mHC checkpoint is another model on vLLM CPU
  whatever serves its attention (``tests_vllm/test_glm5next_wiring.py`` pins both).
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
        "mhc": False,
        "hc_mult": 1,
        "hc_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }


def weights(
    spec: TinyModelSpec, vocab: int, normal: Callable[..., torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Seeded weights under GLM-5.3-Flash's checkpoint names."""
    d, h, r = spec.hidden, spec.heads, spec.q_lora_rank
    n, hd = spec.index_heads, spec.index_head_dim
    out = {"model.embed_tokens.weight": normal(vocab, d)}
    for i in range(spec.layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        ix = f"{a}.indexer"
        out |= {
            f"{p}.input_layernorm.weight": torch.ones(d),
            f"{p}.post_attention_layernorm.weight": torch.ones(d),
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
            f"{p}.mlp.gate_proj.weight": normal(spec.intermediate, d),
            f"{p}.mlp.up_proj.weight": normal(spec.intermediate, d),
            f"{p}.mlp.down_proj.weight": normal(d, spec.intermediate),
        }
    out["model.norm.weight"] = torch.ones(d)
    out["lm_head.weight"] = normal(vocab, d)
    return {name: t.to(torch.bfloat16).float() for name, t in out.items()}
