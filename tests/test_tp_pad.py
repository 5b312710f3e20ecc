"""Head-padded tensor parallelism (``vllm_mla.tp_pad``): the plan, the padded tensors, the
inertness of what padding adds, and ``qualify`` on a padded geometry."""

from __future__ import annotations

import pytest
import torch

from vllm_mla import tp_pad
from vllm_mla.tools import harness, standins
from vllm_mla.tools.qualify import QualifyConfig, failed_checks, run_qualify

# GLM-5's config.json fields that padding reads (zai-org/GLM-5)
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "num_attention_heads": 64,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 78,
    "hidden_size": 6144,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}
# the tiny DSA model of tests_e2e (vllm-mla make-model --sparse)
TINY = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "moe_intermediate_size": 512,
    "n_shared_experts": 1,
}


def test_glm5_at_tp6_pads_heads_to_66_and_the_expert_width_to_whole_blocks():
    pad = tp_pad.plan(GLM5, 6)
    assert pad.widths == {
        "heads": (64, 66),  # 11 per rank
        "moe_intermediate": (2048, 2304),  # 384 = 3 fp8 blocks per rank
        "shared_intermediate": (2048, 2304),
    }  # the dense 12288 = 6 x 2048 needs nothing


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_nothing_changes_where_tp_divides_every_width(tp):
    assert tp_pad.plan(GLM5, tp) is None
    assert tp_pad.plan(TINY, tp if tp <= 4 else 2) is None


def test_the_tiny_model_at_tp3():
    pad = tp_pad.plan(TINY, 3)
    assert pad.widths["heads"] == (4, 6) and pad.widths["intermediate"] == (512, 513)
    assert tp_pad.TPPad.from_record(pad.as_record()) == pad


def test_an_architecture_without_rules_is_refused_by_name():
    with pytest.raises(tp_pad.TPPadError, match=r"\['LlamaForCausalLM'\] has no padding rules"):
        tp_pad.plan({**TINY, "architectures": ["LlamaForCausalLM"]}, 3)
    assert tp_pad.plan({**TINY, "architectures": ["LlamaForCausalLM"]}, 2) is None


def test_a_quantization_without_a_block_size_is_refused():
    with pytest.raises(tp_pad.TPPadError, match="states no block or group size"):
        tp_pad.plan({**GLM5, "quantization_config": {"quant_method": "mystery"}}, 6)


def test_pad_tensor_appends_zero_heads_rows_and_columns():
    pad = tp_pad.plan(TINY, 3)
    q_b = torch.randn(4 * 192, 128)
    out = tp_pad.pad_tensor("model.layers.0.self_attn.q_b_proj.weight", q_b, pad)
    assert out.shape == (6 * 192, 128)
    assert torch.equal(out[: 4 * 192], q_b) and not out[4 * 192 :].any()
    o_proj = torch.randn(256, 4 * 128)
    out = tp_pad.pad_tensor("model.layers.1.self_attn.o_proj.weight", o_proj, pad)
    assert out.shape == (256, 6 * 128) and not out[:, 512:].any()
    down = torch.randn(256, 512)
    out = tp_pad.pad_tensor("model.layers.2.mlp.down_proj.weight", down, pad)
    assert out.shape == (256, 513) and not out[:, 512:].any()
    wq_b = torch.randn(4096, 128)  # the indexer's heads are not TP-sharded: untouched
    assert tp_pad.pad_tensor("model.layers.0.self_attn.indexer.wq_b.weight", wq_b, pad) is wq_b


def test_scales_grow_by_whole_blocks_or_the_tensor_is_named():
    pad = tp_pad.plan(GLM5, 6)
    scale = torch.ones(96, 16)  # q_b_proj's fp8 block scales: 64 x 192 rows / 128
    name = "model.layers.5.self_attn.q_b_proj.weight_scale_inv"
    assert tp_pad.pad_tensor(name, scale, pad).shape == (99, 16)  # 66 x 192 / 128
    per_tensor = torch.ones(1)
    assert tp_pad.pad_tensor("model.layers.5.self_attn.kv_b_proj.input_scale", per_tensor, pad) is (
        per_tensor
    )
    with pytest.raises(tp_pad.TPPadError, match=r"kv_b_proj.weight_scale_inv \(7, 4\)"):
        tp_pad.pad_tensor(
            "model.layers.5.self_attn.kv_b_proj.weight_scale_inv", torch.ones(7, 4), pad
        )


def test_padded_heads_and_rows_are_inert():
    """The error model is none: every added term is an exact zero. A padded head's query
    is 0, its absorbed W_UK/W_UV are 0 (so its output is 0 whatever it attends to), and
    its o_proj columns are 0; a padded MLP row gives silu(0) * 0 = 0."""
    pad = tp_pad.plan(TINY, 3)
    gen = torch.Generator().manual_seed(0)
    name = "model.layers.0.{}.weight"
    kv_b = tp_pad.pad_tensor(name.format("self_attn.kv_b_proj"), torch.randn(4 * 256, 512), pad)
    o_proj = tp_pad.pad_tensor(name.format("self_attn.o_proj"), torch.randn(256, 4 * 128), pad)
    heads = kv_b.view(6, 256, 512)
    w_uk, w_uv = heads[:, :128], heads[:, 128:]
    latent = torch.randn(10, 512, generator=gen)  # what any head attends to
    attn = torch.softmax(torch.randn(6, 10, generator=gen), -1)  # any weights
    out = torch.einsum("hk,kl,hvl->hv", attn, latent, w_uv)  # [6 heads, 128]
    assert not out[4:].any() and not w_uk[4:].any()
    assert not (o_proj[:, 512:] @ out[4:].reshape(-1)).any()  # the o_proj contribution
    up = tp_pad.pad_tensor(name.format("mlp.up_proj"), torch.randn(512, 256), pad)
    gate = tp_pad.pad_tensor(name.format("mlp.gate_proj"), torch.randn(512, 256), pad)
    down = tp_pad.pad_tensor(name.format("mlp.down_proj"), torch.randn(256, 512), pad)
    x = torch.randn(256, generator=gen)
    mid = torch.nn.functional.silu(gate @ x) * (up @ x)
    assert not mid[512:].any() and not (down[:, 512:] @ mid[512:]).any()


def test_vocabulary_is_padded_to_a_share_per_rank_only_where_tp_does_not_divide_it():
    assert tp_pad.padded_vocab(1024, 64, 3) == 1152  # lcm(64, 3) = 192
    assert tp_pad.padded_vocab(1024, 64, 2) == 1024
    assert tp_pad.padded_vocab(154880, 64, 6) == 154944  # GLM-5's: lcm(64, 6) = 192
    assert tp_pad.padded_vocab(154880, 64, 8) == 154880


def test_padding_bytes_counts_heads_and_expert_rows():
    pad = tp_pad.plan(GLM5, 6)
    per_head = 2048 * 256 + 512 * (192 + 256) + 256 * 6144
    experts = 256 * 256 * 3 * 6144 * 75  # 256 extra rows x 256 experts x 75 MoE layers
    shared = 256 * 3 * 6144 * 75
    assert tp_pad.padding_bytes(pad, GLM5, 1) == 2 * per_head * 78 + experts + shared


def test_qualify_reports_the_padded_geometry_and_its_cost():
    report = run_qualify(QualifyConfig(preset="glm-5", tp=6, rank=5, layers=2, device="cpu"))
    pad = report["padding"]
    assert report["heads_per_rank"] == 11 and report["real_heads"] == 9
    assert pad["padded_heads_total"] == 66 and pad["padded_heads_on_rank"] == 2
    per_head = (192 * 512 + 512 * 256) * 2  # bf16 pair
    assert pad["pair_bytes_on_rank"] == pad["pair_bytes_all_ranks"] == 2 * per_head * 2
    assert report["checks"]["padded_heads_zero"] and not failed_checks(report)


def test_qualify_fails_a_padded_head_that_is_not_zero(monkeypatch):
    """Break the rule once: synthetic kv_b_proj weights with non-zero padded rows."""
    real = standins.synthetic_weight

    def leaky(geo, **kw):
        weight = real(geo, **kw)
        weight[geo.real_heads * 448 :] = 1.0
        return weight

    monkeypatch.setattr(harness, "synthetic_weight", leaky)
    report = run_qualify(QualifyConfig(preset="glm-5", tp=6, rank=5, layers=1, device="cpu"))
    assert "padded_heads_zero" in failed_checks(report)
