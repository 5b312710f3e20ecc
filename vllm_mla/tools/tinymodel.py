"""A tiny DeepSeek-V2-style MLA checkpoint, made locally (``vllm-mla make-model``).

The folder holds a transformers ``config.json`` (``deepseek_v2``, dense layers,
no q LoRA), ``model.safetensors`` and a byte-level BPE tokenizer trained here on a
seeded synthetic corpus, so vLLM and transformers can both load it with no download.
Weights are N(0, init_std) (norms 1); a large ``init_std`` keeps logits far from
uniform, which end-to-end comparisons need to see real differences.

With ``sparse=True`` the model is DeepSeek-V3.2-architecture (``deepseek_v32``, what
GLM-5 and DeepSeek-V3.2 checkpoints are): q LoRA (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj``) and a DSA lightning indexer per layer (``indexer.wq_b``, ``wk``, ``k_norm``,
``weights_proj``) selecting ``index_topk`` tokens; transformers' own DeepseekV32 classes
load it.

With ``mtp_layers=N`` (sparse only) the checkpoint also carries N multi-token-prediction
layers after the decoder layers, under the names DeepSeek-V3 checkpoints use and vLLM's
``DeepSeekMTP`` loads (``model.layers.{L}.``: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, ``shared_head.head`` and a whole decoder layer, indexer included),
``num_nextn_predict_layers`` set: speculative decoding with ``method="mtp"``. transformers
has no MTP layers and warns about those weights, so the MTP folder is for vLLM runs only.
With ``arch="hy-v4"`` they are HY-V4's (``model.mtp_layers.{j}.``: ``enorm``, ``hnorm``,
``eh_proj``, ``final_layernorm`` and a MoE decoder layer with its own indexer, no iHC:
what vLLM's ``HYV4MTP`` loads; transformers ignores them).

With ``kv_b_format="fp8-block"`` kv_b_proj is stored as DeepSeek block FP8 (e4m3
``weight`` + fp32 ``weight_scale_inv`` per 128x128) and every other layer stays
fp32 (``modules_to_not_convert``); ``kv_b_exact=True`` instead stores fp32 values
that block FP8 represents exactly, so a transformers fp32 run of the dense folder
sees the same numbers as vLLM's FP8 layer.

With ``kv_b_format="mxfp8"`` kv_b_proj is an MXFP8 compressed-tensors layer (e4m3
``weight`` + uint8 E8M0 ``weight_scale`` per 32 input columns, ``format:
mxfp8-quantized``, the only target), everything else fp32; ``kv_b_exact="mxfp8"``
stores fp32 values on the MXFP8 grid for the fp32 twin.

With ``arch="hy-v4"`` the checkpoint is Tencent HY-V4 (``hy_v4``, ``HYV4ForCausalLM``):
MLA 576 (kv_lora_rank 512, rope 64; HY-V4's qk_nope 192 and v 256), q LoRA, a V3.2
lightning indexer on the "full" indexer layers (HY-V4's pattern: layer 0 and every fourth
from layer 1; the others are "shared" and reuse the last full layer's top-k), an
elementwise output gate (``linear_gate``), a learnable per-head attention sink
(``learnable_sink_param``, drawn nonzero so it changes the output), iHC hyper-connections
(``hc_mult`` residual streams: ``hc_attn_layer`` / ``hc_mlp_layer`` and ``hc_head``), a
dense first layer and sigmoid-routed MoE layers after it (``experts`` small experts, fused
``gate_up_proj`` / ``down_proj``, one shared expert). Tensors carry the original checkpoint
names vLLM's ``HYV4ForCausalLM`` loads; transformers' ``HYV4ForCausalLM`` renames them on
load (its ``conversion_mapping``), so both load the folder with no missing keys.
``swiglu_limit`` is set far above any activation of these weights (the routed-expert clamp
never engages), and ``rms_norm_eps`` 1e-6 is the eps both implementations hard-code in
places (q/kv LoRA norms, the indexer's key norm).

With ``arch="glm5-next"`` the checkpoint is GLM-5.3-Flash's text model (``glm5_next``,
``Glm5NextForCausalLM``): MLA of latent 512 without RoPE and the kpool indexer, every
layer MLA (or, with ``kda``, KDA linear attention on three layers of four, as the
checkpoint) with a dense MLP and no mHC (``tiny_glm5next`` says what and why).

With ``arch="deepseek-v4"`` the checkpoint is DeepSeek-V4's text model (``deepseek_v4``,
``DeepseekV4ForCausalLM``) under its original tensor names: attention of head 512 with a
sliding window, C4 (indexed) and C128 compressed layers, the sink, mHC and MoE with hash
routing first (``tiny_deepseekv4`` says what and why).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_mla.formats import LATENT
from vllm_mla.quant import fp8_block, mxfp8
from vllm_mla.tools import tiny_deepseekv4, tiny_glm5next

KV_LORA_RANK = LATENT
QK_ROPE = 64
QK_NOPE = 128
V_HEAD = 128
KV_B_FORMATS = ("fp32", "fp8-block", "mxfp8")
EXACT_GRIDS = ("fp8-block", "mxfp8")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
ARCHS = ("deepseek", "hy-v4", "glm5-next", "deepseek-v4")
NEW_ARCHS = ARCHS[1:]  # DSA-family architectures: their own configs, fp32 kv_b only
HYV4_QK_NOPE = 192  # HY-V4's qk_nope_head_dim and v_head_dim (DeepSeek's are 128 / 128)
HYV4_V_HEAD = 256
SWIGLU_LIMIT = 1000.0  # far above any (expert) activation here: the clamp never engages


class MakeModelError(ValueError):
    """A make-model setting that cannot produce a loadable checkpoint."""


@dataclass(frozen=True)
class TinyModelSpec:
    """What ``make_model`` writes; defaults give a ~7 MB, 2-layer, 4-head model."""

    layers: int | None = None  # None: 2 (deepseek-v4: 4, every layer kind)
    heads: int = 4
    hidden: int = 256
    intermediate: int = 512
    vocab: int = 1024
    seed: int = 0
    init_std: float = 0.15
    kv_b_format: str = "fp32"
    kv_b_exact: bool | str = False  # True / "fp8-block" / "mxfp8": fp32 values on that grid
    max_position: int = 2048
    sparse: bool = False  # DeepSeek-V3.2 (DSA) architecture
    q_lora_rank: int = 128  # sparse only
    index_topk: int = 32  # sparse only: tokens the indexer keeps per query
    index_heads: int = 32  # sparse only; >= 32 keeps ReLU ties at 0 from deciding top-k
    index_head_dim: int = 128  # sparse only (vLLM's indexer is written for 128)
    mtp_layers: int = 0  # sparse only: multi-token-prediction layers (speculative decoding)
    arch: str = "deepseek"  # "deepseek" (V2, or V3.2 with sparse); "hy-v4", "glm5-next" (DSA),
    # "deepseek-v4"
    # routed experts (glm5-next: declared, its MLPs are dense) and experts per token; None:
    # the architecture's default (4 / 2; deepseek-v4: 64 / 6, what vLLM CPU's routers take)
    experts: int | None = None
    experts_per_tok: int | None = None
    hc_mult: int = 4  # hy-v4, deepseek-v4, and glm5-next with mhc: hyper-connection streams
    sink_logit: float = 2.0  # hy-v4, deepseek-v4: mean of the per-head sink logits (std 1)
    window: int = 128  # deepseek-v4 only: the sliding window every layer attends to
    kda: bool = False  # glm5-next only: KDA layers in the checkpoint's pattern (3 of 4)
    mhc: bool = False  # glm5-next only: mHC (hc_mult streams, the Sinkhorn-mixed residual)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise MakeModelError(f"--arch must be one of {ARCHS}, got {self.arch!r}")
        v4 = self.arch == "deepseek-v4"
        defaults = {
            "layers": 4 if v4 else 2,
            "experts": tiny_deepseekv4.DEFAULT_EXPERTS if v4 else 4,
            "experts_per_tok": tiny_deepseekv4.DEFAULT_EXPERTS_PER_TOK if v4 else 2,
        }
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)  # frozen: resolved once, here
        for flag in ("kda", "mhc"):
            if getattr(self, flag) and self.arch != "glm5-next":
                raise MakeModelError(f"--{flag} is made for --arch glm5-next only, not {self.arch}")
        if self.arch in NEW_ARCHS:
            self._check_new_arch()
        for name in ("layers", "heads", "hidden", "intermediate"):
            if getattr(self, name) < 1:
                raise MakeModelError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab < 300:
            raise MakeModelError(f"vocab must be >= 300 (256 bytes + specials), got {self.vocab}")
        if not self.init_std > 0:
            raise MakeModelError(f"--init-std must be > 0, got {self.init_std}")
        if self.dsa:
            for name in ("q_lora_rank", "index_topk", "index_heads"):
                if getattr(self, name) < 1:
                    raise MakeModelError(f"--{name.replace('_', '-')} must be >= 1")
            if self.mtp_layers < 0:
                raise MakeModelError(f"--mtp-layers must be >= 0, got {self.mtp_layers}")
            if self.index_head_dim != 128:
                raise MakeModelError(
                    f"--index-head-dim must be 128 (vLLM's indexer), got {self.index_head_dim}"
                )
        elif self.mtp_layers:
            raise MakeModelError("--mtp-layers needs --sparse (DeepSeek-V3.2 MTP layers)")
        if self.kv_b_format not in KV_B_FORMATS:
            raise MakeModelError(
                f"kv_b format must be one of {KV_B_FORMATS}, got {self.kv_b_format!r}"
            )
        if self.kv_b_exact not in (False, True, *EXACT_GRIDS):
            raise MakeModelError(
                f"kv_b exact grid must be one of {EXACT_GRIDS}, got {self.kv_b_exact!r}"
            )

    def _check_new_arch(self) -> None:
        unsupported = {
            "kv_b_format": (self.kv_b_format, "fp32"),
            "kv_b_exact": (self.kv_b_exact, False),
        }
        if self.arch in ("glm5-next", "deepseek-v4"):
            unsupported["mtp_layers"] = (self.mtp_layers, 0)
        if self.arch != "deepseek-v4":
            unsupported["window"] = (self.window, 128)
        for name, (value, only) in unsupported.items():
            if value != only:
                raise MakeModelError(
                    f"--{name.replace('_', '-')} {value!r} is not made for --arch {self.arch} "
                    f"(only {only!r})"
                )
        if self.arch == "glm5-next":
            if self.kda and self.layers < 4:
                raise MakeModelError(
                    f"--kda needs --layers >= 4 (layer 3 is the first MLA layer in "
                    f"GLM-5.3-Flash's pattern), got {self.layers}"
                )
            if self.mhc and self.hc_mult < 2:
                raise MakeModelError(f"--mhc needs --hc-mult >= 2, got {self.hc_mult}")
            if self.index_topk % tiny_glm5next.KPOOL:
                raise MakeModelError(
                    f"--index-topk {self.index_topk} must be a multiple of GLM-5.3-Flash's "
                    f"index_kpool {tiny_glm5next.KPOOL}"
                )
            return
        if self.arch == "deepseek-v4":
            self._check_deepseek_v4()
        elif self.layers < 2:
            raise MakeModelError(
                f"--arch hy-v4 needs --layers >= 2 (a dense layer, then MoE), got {self.layers}"
            )
        for name in ("experts", "experts_per_tok", "hc_mult"):
            if getattr(self, name) < 1:
                raise MakeModelError(f"--{name.replace('_', '-')} must be >= 1")
        if self.experts_per_tok > self.experts:
            raise MakeModelError(
                f"--experts-per-tok {self.experts_per_tok} > --experts {self.experts}"
            )

    def _check_deepseek_v4(self) -> None:
        v4 = tiny_deepseekv4
        if self.layers < 3:
            raise MakeModelError(
                f"--arch deepseek-v4 needs --layers >= 3 (a window-only, a C4 and a C128 "
                f"layer), got {self.layers}"
            )
        if self.heads % v4.O_GROUPS:
            raise MakeModelError(
                f"--heads {self.heads} must be a multiple of the output projection's "
                f"{v4.O_GROUPS} head groups (o_groups)"
            )
        if self.hc_mult < 2:
            raise MakeModelError(f"--hc-mult must be >= 2 for deepseek-v4, got {self.hc_mult}")
        if self.window < 1:
            raise MakeModelError(f"--window must be >= 1, got {self.window}")
        if v4.moe_intermediate(self) < 1:
            raise MakeModelError(f"--intermediate {self.intermediate} leaves experts no width")

    @property
    def dsa(self) -> bool:
        """A DSA model: DeepSeek-V3.2 (``sparse``), HY-V4 or GLM-5.3-Flash (always)."""
        return self.sparse or self.arch != "deepseek"

    @property
    def kv_b_grid(self) -> str | None:
        """The quantized grid kv_b_proj's values lie on (None: free fp32 values)."""
        if self.kv_b_format != "fp32":
            return self.kv_b_format
        if self.kv_b_exact is True:
            return "fp8-block"
        return self.kv_b_exact or None


def config_dict(spec: TinyModelSpec, vocab: int) -> dict:
    """The transformers ``DeepseekV2Config`` fields of the model (dense layers only)."""
    if spec.arch == "hy-v4":
        return hyv4_config_dict(spec, vocab)
    if spec.arch == "glm5-next":
        return dsa_model_fields(spec, vocab) | tiny_glm5next.config_fields(spec)
    if spec.arch == "deepseek-v4":
        return {"vocab_size": vocab} | tiny_deepseekv4.config_fields(spec)
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "moe_intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "first_k_dense_replace": spec.layers + spec.mtp_layers,  # all dense: no MoE
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "moe_layer_freq": 1,
        "q_lora_rank": None,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_rope_head_dim": QK_ROPE,
        "qk_nope_head_dim": QK_NOPE,
        "v_head_dim": V_HEAD,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "initializer_range": spec.init_std,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if spec.sparse:
        config |= {
            "architectures": ["DeepseekV32ForCausalLM"],
            "model_type": "deepseek_v32",
            "q_lora_rank": spec.q_lora_rank,
            "index_topk": spec.index_topk,
            "index_n_heads": spec.index_heads,
            "index_head_dim": spec.index_head_dim,
            "n_group": 1,
            "topk_group": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }
        if spec.mtp_layers:
            config["num_nextn_predict_layers"] = spec.mtp_layers
    if spec.kv_b_format == "fp8-block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": _fp32_modules(spec),
        }
    if spec.kv_b_format == "mxfp8":
        weights = {
            "num_bits": 8,
            "type": "float",
            "strategy": "group",
            "group_size": mxfp8.BLOCK_SIZE,
            "symmetric": True,
            "dynamic": False,
            "scale_dtype": "torch.uint8",
        }
        group = {
            "targets": ["re:.*kv_b_proj$"],
            "weights": weights,
            "input_activations": dict(weights, dynamic=True),
        }
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp8-quantized",
            "config_groups": {"group_0": group},
            "ignore": [],
        }
    return config


def hyv4_indexer_types(layers: int) -> list[str]:
    """HY-V4's indexer pattern: a full indexer on layer 0 and every fourth from layer 1."""
    return ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)]


def dsa_model_fields(spec: TinyModelSpec, vocab: int) -> dict:
    """The config fields HY-V4's and GLM-5.3-Flash's configs share: sizes, MoE routing,
    q LoRA, the indexer's heads and top-k, the SwiGLU clamp, the special tokens."""
    return {
        "vocab_size": vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "moe_intermediate_size": spec.intermediate // 4,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "initializer_range": spec.init_std,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "n_routed_experts": spec.experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": spec.experts_per_tok,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": spec.q_lora_rank,
        "kv_lora_rank": KV_LORA_RANK,
        "layer_types": ["indexed_attention"] * spec.layers,
        "index_topk": spec.index_topk,
        "index_head_dim": spec.index_head_dim,
        "index_n_heads": spec.index_heads,
        "swiglu_limit": SWIGLU_LIMIT,
        "num_nextn_predict_layers": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
        "use_cache": True,
    }


def hyv4_config_dict(spec: TinyModelSpec, vocab: int) -> dict:
    """The ``hy_v4`` config: every field transformers' and vLLM's ``HYV4Config`` read
    (vLLM turns iHC, the gate and the sink on only where the config says so)."""
    return {
        "architectures": ["HYV4ForCausalLM"],
        "model_type": "hy_v4",
        **dsa_model_fields(spec, vocab),
        "head_dim": QK_ROPE,
        "attention_dropout": 0.0,
        "norm_topk_prob": True,
        "qk_nope_head_dim": HYV4_QK_NOPE,
        "qk_rope_head_dim": QK_ROPE,
        "v_head_dim": HYV4_V_HEAD,
        "mlp_layer_types": ["dense"] + ["sparse"] * (spec.layers - 1),
        "indexer_types": hyv4_indexer_types(spec.layers),
        "enable_ihc": True,
        "hc_mult": spec.hc_mult,
        "hc_magnitude": 2.0,
        "hc_eps": 1e-6,
        "gated_mla": True,
        "gating_type": "elementwise",
        "learnable_sink": True,
        "learnable_sink_init": 0.0,
        "enable_lm_head_fp32": True,
        "num_nextn_predict_layers": spec.mtp_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "torch_dtype": "float32",
    }


def _fp32_modules(spec: TinyModelSpec) -> list[str]:
    names = ["lm_head"]
    for i in range(spec.layers + spec.mtp_layers):
        p = f"model.layers.{i}"
        q = ("q_a_proj", "q_b_proj") if spec.sparse else ("q_proj",)
        names += [f"{p}.self_attn.{n}" for n in (*q, "kv_a_proj_with_mqa", "o_proj")]
        if spec.sparse:
            names += [f"{p}.self_attn.indexer.{n}" for n in ("wq_b", "wk", "weights_proj")]
        names += [f"{p}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
        if i >= spec.layers:
            names += [f"{p}.eh_proj", f"{p}.shared_head.head"]
    return names


def weights(spec: TinyModelSpec, vocab: int) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights under transformers' DeepSeek-V2 names (MTP layers drawn last, so
    the model itself is the same with or without them)."""
    gen = torch.Generator().manual_seed(spec.seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * spec.init_std

    if spec.arch == "hy-v4":
        return _hyv4_weights(spec, vocab, gen, normal)
    if spec.arch == "glm5-next":
        return tiny_glm5next.weights(spec, vocab, normal)
    if spec.arch == "deepseek-v4":
        return tiny_deepseekv4.weights(spec, vocab, gen, normal)
    d = spec.hidden
    out = {"model.embed_tokens.weight": normal(vocab, d)}
    for i in range(spec.layers):
        out |= _decoder_layer(spec, f"model.layers.{i}", normal)
    out["model.norm.weight"] = torch.ones(d)
    out["lm_head.weight"] = normal(vocab, d)
    for i in range(spec.layers, spec.layers + spec.mtp_layers):
        p = f"model.layers.{i}"
        out |= _decoder_layer(spec, p, normal) | {
            f"{p}.enorm.weight": torch.ones(d),
            f"{p}.hnorm.weight": torch.ones(d),
            f"{p}.eh_proj.weight": normal(d, 2 * d),
            f"{p}.shared_head.norm.weight": torch.ones(d),
            f"{p}.shared_head.head.weight": normal(vocab, d),
        }
    return out


def _decoder_layer(spec: TinyModelSpec, p: str, normal) -> dict[str, torch.Tensor]:
    """One decoder layer's weights under prefix ``p``."""
    h, d = spec.heads, spec.hidden
    out = {}
    kv_b = normal(h * (QK_NOPE + V_HEAD), KV_LORA_RANK)
    if spec.kv_b_grid == "fp8-block":
        kv_b = fp8_block.dequantize(fp8_block.quantize(kv_b), torch.float32)
    elif spec.kv_b_grid == "mxfp8":
        kv_b = mxfp8.dequantize(mxfp8.quantize(kv_b, axis=-1), torch.float32)
    if spec.sparse:
        out |= _sparse_attention(spec, p, normal)
    else:
        out[f"{p}.self_attn.q_proj.weight"] = normal(h * (QK_NOPE + QK_ROPE), d)
    out |= {
        f"{p}.input_layernorm.weight": torch.ones(d),
        f"{p}.post_attention_layernorm.weight": torch.ones(d),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": normal(KV_LORA_RANK + QK_ROPE, d),
        f"{p}.self_attn.kv_a_layernorm.weight": torch.ones(KV_LORA_RANK),
        f"{p}.self_attn.kv_b_proj.weight": kv_b,
        f"{p}.self_attn.o_proj.weight": normal(d, h * V_HEAD),
        f"{p}.mlp.gate_proj.weight": normal(spec.intermediate, d),
        f"{p}.mlp.up_proj.weight": normal(spec.intermediate, d),
        f"{p}.mlp.down_proj.weight": normal(d, spec.intermediate),
    }
    if spec.kv_b_format == "fp8-block":
        packed = fp8_block.quantize(kv_b)
        out[f"{p}.self_attn.kv_b_proj.weight"] = packed.values
        out[f"{p}.self_attn.kv_b_proj.weight_scale_inv"] = packed.scale_inv
    elif spec.kv_b_format == "mxfp8":
        packed = mxfp8.quantize(kv_b, axis=-1)
        out[f"{p}.self_attn.kv_b_proj.weight"] = packed.values
        out[f"{p}.self_attn.kv_b_proj.weight_scale"] = packed.scales
    return out


def _sparse_attention(spec: TinyModelSpec, p: str, normal) -> dict[str, torch.Tensor]:
    """q LoRA and the DSA indexer of one DeepSeek-V3.2 layer (transformers' names)."""
    d, r, n, hd = spec.hidden, spec.q_lora_rank, spec.index_heads, spec.index_head_dim
    a, ix = f"{p}.self_attn", f"{p}.self_attn.indexer"
    return {
        f"{a}.q_a_proj.weight": normal(r, d),
        f"{a}.q_a_layernorm.weight": torch.ones(r),
        f"{a}.q_b_proj.weight": normal(spec.heads * (QK_NOPE + QK_ROPE), r),
        f"{ix}.wq_b.weight": normal(n * hd, r),
        f"{ix}.wk.weight": normal(hd, d),
        f"{ix}.k_norm.weight": torch.ones(hd),
        f"{ix}.k_norm.bias": torch.zeros(hd),
        f"{ix}.weights_proj.weight": normal(n, d),
    }


def _hyv4_weights(spec: TinyModelSpec, vocab: int, gen, normal) -> dict[str, torch.Tensor]:
    """HY-V4 weights under the original checkpoint names (what vLLM loads)."""
    d, h, r, hc = spec.hidden, spec.heads, spec.q_lora_rank, spec.hc_mult
    n, hd, e = spec.index_heads, spec.index_head_dim, spec.experts
    moe = spec.intermediate // 4

    def hyper(prefix: str, outputs: int, scales: int) -> dict[str, torch.Tensor]:
        # HY-V4's init for base and scale (-log(hc - 1) on the pre gates, 0.01), plus
        # noise so every stream and gate differs
        base = torch.zeros(outputs)
        base[:hc] = -math.log(max(hc - 1, 1))
        return {
            f"{prefix}_fn": normal(outputs, hc * d),
            f"{prefix}_base": base + 0.1 * torch.randn(outputs, generator=gen),
            f"{prefix}_scale": 0.1 + 0.05 * torch.rand(scales, generator=gen),
        }

    def layer(p: str, moe_layer: bool, indexer: bool, streams: bool) -> dict[str, torch.Tensor]:
        a = f"{p}.self_attn"
        out = {
            f"{p}.input_layernorm.weight": torch.ones(d),
            f"{p}.post_attention_layernorm.weight": torch.ones(d),
            f"{a}.q_a_proj.weight": normal(r, d),
            f"{a}.q_a_layernorm.weight": torch.ones(r),
            f"{a}.q_b_proj.weight": normal(h * (HYV4_QK_NOPE + QK_ROPE), r),
            f"{a}.kv_a_proj_with_mqa.weight": normal(KV_LORA_RANK + QK_ROPE, d),
            f"{a}.kv_a_layernorm.weight": torch.ones(KV_LORA_RANK),
            f"{a}.kv_b_proj.weight": normal(h * (HYV4_QK_NOPE + HYV4_V_HEAD), KV_LORA_RANK),
            f"{a}.o_proj.weight": normal(d, h * HYV4_V_HEAD),
            f"{a}.linear_gate.weight": normal(h * HYV4_V_HEAD, d),
            f"{a}.learnable_sink_param": spec.sink_logit + torch.randn(h, generator=gen),
        }
        if indexer:
            out |= {
                f"{a}.indexer.wq_b.weight": normal(n * hd, r),
                f"{a}.indexer.wk.weight": normal(hd, d),
                f"{a}.indexer.k_norm.weight": torch.ones(hd),
                f"{a}.indexer.k_norm.bias": torch.zeros(hd),
                f"{a}.indexer.weights_proj.weight": normal(n, d),
            }
        if streams:
            out |= hyper(f"{p}.hc_attn_layer.hc_pre.hc", 2 * hc, 2)
            out |= hyper(f"{p}.hc_mlp_layer.hc_pre.hc", 2 * hc, 2)
        if not moe_layer:
            return out | {
                f"{p}.mlp.gate_proj.weight": normal(spec.intermediate, d),
                f"{p}.mlp.up_proj.weight": normal(spec.intermediate, d),
                f"{p}.mlp.down_proj.weight": normal(d, spec.intermediate),
            }
        return out | {
            f"{p}.mlp.gate.weight": normal(e, d),
            f"{p}.mlp.gate.e_score_correction_bias": 0.1 * torch.randn(e, generator=gen),
            f"{p}.mlp.experts.gate_up_proj": normal(e, 2 * moe, d),
            f"{p}.mlp.experts.down_proj": normal(e, d, moe),
            f"{p}.mlp.shared_experts.gate_proj.weight": normal(moe, d),
            f"{p}.mlp.shared_experts.up_proj.weight": normal(moe, d),
            f"{p}.mlp.shared_experts.down_proj.weight": normal(d, moe),
        }

    out = {"model.embed_tokens.weight": normal(vocab, d)}
    types = hyv4_indexer_types(spec.layers)
    for i in range(spec.layers):
        out |= layer(f"model.layers.{i}", i > 0, types[i] == "full", True)
    out |= hyper("model.hc_head.hc_head", hc, 1)
    out["model.norm.weight"] = torch.ones(d)
    out["lm_head.weight"] = normal(vocab, d)
    # MTP layers (HY-V4's names; drawn last: the model is the same with or without them),
    # each a MoE layer with its own indexer and without iHC (vLLM's HYV4MTP builds them so)
    for j in range(spec.mtp_layers):
        p = f"model.mtp_layers.{j}"
        out |= layer(p, True, True, False) | {
            f"{p}.enorm.weight": torch.ones(d),
            f"{p}.hnorm.weight": torch.ones(d),
            f"{p}.eh_proj.weight": normal(d, 2 * d),
            f"{p}.final_layernorm.weight": torch.ones(d),
        }
    return out


def _corpus(seed: int, words: int = 20000) -> list[str]:
    """Seeded pseudo-words: enough distinct pairs for a 1k BPE vocabulary."""
    rng = random.Random(seed)
    onsets = [*"bcdfghjklmnprstvwz", "br", "cr", "dr", "st", "tr", "pl", "gr", "sh", "ch", "th"]
    vowels = [*"aeiou", "ai", "ea", "ou", "io"]
    codas = ["", "n", "r", "s", "t", "l", "nd", "st", "rk"]
    vocab = [
        "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
            for _ in range(rng.randint(1, 3))
        )
        for _ in range(3000)
    ]
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(vocab))
        if len(line) >= rng.randint(6, 14):
            lines.append(" ".join(line).capitalize() + rng.choice([".", ",", "!", "?"]))
            line = []
    return lines


def train_tokenizer(vocab: int, seed: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab`` entries."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:  # pragma: no cover - tokenizers is a declared dependency
        raise MakeModelError("make-model needs the 'tokenizers' package") from exc
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab:
        raise MakeModelError(
            f"tokenizer trained to {tok.get_vocab_size()} entries, expected {vocab}"
        )
    return tok


def make_model(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write the checkpoint folder; returns its path. Existing files are overwritten."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec.vocab, spec.seed)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "model_max_length": spec.max_position,
            },
            indent=2,
        )
    )
    (folder / "config.json").write_text(json.dumps(config_dict(spec, spec.vocab), indent=2))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2}, indent=2)
    )
    tensors = {k: v.contiguous() for k, v in weights(spec, spec.vocab).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
