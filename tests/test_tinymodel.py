"""`vllm-mla make-model`: a tiny local MLA checkpoint that vLLM and transformers load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from vllm_mla.geometry import GeometryError, from_hf_config
from vllm_mla.quant import fp8_block, mxfp8
from vllm_mla.tools.cli import main
from vllm_mla.tools.qualify import QualifyConfig, run_qualify
from vllm_mla.tools.tinymodel import MakeModelError, TinyModelSpec, make_model, weights

SMALL = TinyModelSpec(layers=2, heads=2, hidden=64, intermediate=128, vocab=320)


def read(folder):
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "small", SMALL)


def test_folder_has_config_weights_and_tokenizer(small):
    config = json.loads((small / "config.json").read_text())
    assert config["model_type"] == "deepseek_v2" and config["q_lora_rank"] is None
    assert config["first_k_dense_replace"] == SMALL.layers  # dense layers only
    geo = from_hf_config(small)
    assert (geo.num_heads, geo.kv_lora_rank, geo.qk_rope_head_dim) == (2, 512, 64)
    assert (geo.qk_nope_head_dim, geo.v_head_dim, geo.num_layers) == (128, 128, 2)
    tensors = read(small)
    assert tensors["model.layers.1.self_attn.kv_b_proj.weight"].shape == (2 * 256, 512)
    assert tensors["model.embed_tokens.weight"].shape == (320, 64)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(small / "tokenizer.json"))
    assert tok.get_vocab_size() == config["vocab_size"] == 320
    ids = tok.encode("Brai stou dra").ids
    assert ids and tok.decode(ids) == "Brai stou dra"


def test_weights_follow_seed_and_std():
    a, b = weights(SMALL, 320), weights(SMALL, 320)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = weights(TinyModelSpec(**{**SMALL.__dict__, "seed": 1}), 320)
    assert not torch.equal(a["lm_head.weight"], other["lm_head.weight"])
    std = a["model.layers.0.self_attn.q_proj.weight"].std().item()
    # sample std of 384 x 64 N(0, 0.15) draws: standard error 0.15 / sqrt(2 n) ~ 7e-4, so
    # 0.01 is ~15 of them, and a wrong std (0.1, 0.2) is 70 away
    assert abs(std - SMALL.init_std) < 0.01


def test_fp8_block_kv_b_proj_and_exact_twin(tmp_path):
    spec = TinyModelSpec(**{**SMALL.__dict__, "kv_b_format": "fp8-block"})
    folder = make_model(tmp_path / "fp8", spec)
    tensors = read(folder)
    key = "model.layers.0.self_attn.kv_b_proj"
    assert tensors[f"{key}.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"{key}.weight_scale_inv"].shape == (4, 4)
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant["weight_block_size"] == [128, 128]
    assert f"{key}".replace("kv_b_proj", "q_proj") in quant["modules_to_not_convert"]
    assert not any("kv_b_proj" in m for m in quant["modules_to_not_convert"])
    # the fp32 twin holds exactly the values block FP8 decodes to
    twin = weights(TinyModelSpec(**{**SMALL.__dict__, "kv_b_exact": True}), 320)
    packed = fp8_block.FP8BlockTensor(tensors[f"{key}.weight"], tensors[f"{key}.weight_scale_inv"])
    assert torch.equal(twin[f"{key}.weight"], fp8_block.dequantize(packed, torch.float32))
    plain = weights(SMALL, 320)
    assert not torch.equal(plain[f"{key}.weight"], twin[f"{key}.weight"])


def test_mxfp8_kv_b_proj_and_exact_twin(tmp_path):
    spec = TinyModelSpec(**{**SMALL.__dict__, "kv_b_format": "mxfp8"})
    folder = make_model(tmp_path / "mx", spec)
    tensors = read(folder)
    key = "model.layers.0.self_attn.kv_b_proj"
    values, scales = tensors[f"{key}.weight"], tensors[f"{key}.weight_scale"]
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8
    assert scales.shape == (values.shape[0], values.shape[1] // 32)
    assert f"{key}.weight_scale_inv" not in tensors
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "mxfp8-quantized"
    assert quant["config_groups"]["group_0"]["targets"] == ["re:.*kv_b_proj$"]
    twin = weights(TinyModelSpec(**{**SMALL.__dict__, "kv_b_exact": "mxfp8"}), 320)
    decoded = mxfp8.dequantize(mxfp8.MXFP8Tensor(values, scales, 1), torch.float32)
    assert torch.equal(twin[f"{key}.weight"], decoded)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("vocab", 100, "vocab must be >= 300"),
        ("init_std", 0.0, "--init-std must be > 0"),
        ("heads", 0, "--heads must be >= 1"),
        ("kv_b_format", "int4", "kv_b format must be one of"),
        ("kv_b_exact", "int4", "kv_b exact grid must be one of"),
    ],
)
def test_bad_specs_name_the_setting(field, value, message):
    with pytest.raises(MakeModelError, match=message):
        TinyModelSpec(**{field: value})


def test_cli_make_model(tmp_path, capsys):
    args = ["make-model", str(tmp_path / "m"), "--layers", "1", "--heads", "2", "--hidden", "64"]
    assert main(args) == 0
    assert "1 layers, 2 heads" in capsys.readouterr().out
    assert from_hf_config(tmp_path / "m").num_layers == 1
    assert main(["make-model", str(tmp_path / "bad"), "--init-std", "-1"]) == 2
    assert "--init-std must be > 0" in capsys.readouterr().err


def test_geometry_from_a_non_mla_config_names_the_missing_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 8}))
    with pytest.raises(GeometryError, match="missing qk_nope_head_dim"):
        from_hf_config(tmp_path)
    with pytest.raises(GeometryError, match=r"not a readable config\.json"):
        from_hf_config(tmp_path / "absent")


def test_qualify_a_model_folder_in_fp32_predicts_the_aliased_pair(small):
    report = run_qualify(QualifyConfig(model=str(small), tp=1, dtype="float32", mha_prefill=True))
    assert (report["preset"], report["layers"], report["weights"]) == ("small", 2, "fp32")
    kv_b_bytes = 2 * 256 * 512 * 4
    assert report["lean"]["absorbed_bytes"] == 2 * kv_b_bytes  # views of the source
    assert report["lean"]["resident_bytes"] == report["baseline"]["resident_bytes"]
    assert report["reclaimed_bytes"] == 0 and report["checks"]["parity_ok"]
    assert any("aliases the dense source" in n for n in report["notes"])


def test_qualify_a_model_folder_in_bf16_copies_the_pair(small):
    report = run_qualify(QualifyConfig(model=str(small), tp=1, mha_prefill=True))
    kv_b_bytes = 2 * 256 * 512
    assert report["lean"]["absorbed_bytes"] == 2 * kv_b_bytes * 2  # bf16 pair
    assert report["lean"]["source_bytes"] == 2 * kv_b_bytes * 4  # fp32 source kept
    assert not any("aliases" in n for n in report["notes"])


def test_qualify_rejects_an_unknown_dtype():
    from vllm_mla.tools.qualify import QualifyError

    with pytest.raises(QualifyError, match="--dtype must be one of bfloat16, float32"):
        run_qualify(QualifyConfig(preset="deepseek-v2-lite", tp=1, layers=1, dtype="half"))


def test_sparse_checkpoint_has_the_dsa_indexer_and_q_lora(tmp_path):
    spec = TinyModelSpec(**{**SMALL.__dict__, "sparse": True, "index_topk": 8})
    folder = make_model(tmp_path / "dsa", spec)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32"
    assert config["architectures"] == ["DeepseekV32ForCausalLM"]
    assert (config["index_topk"], config["index_n_heads"], config["index_head_dim"]) == (8, 32, 128)
    tensors = read(folder)
    p = "model.layers.1.self_attn"
    assert tensors[f"{p}.q_a_proj.weight"].shape == (128, 64)
    assert tensors[f"{p}.q_b_proj.weight"].shape == (2 * 192, 128)
    assert tensors[f"{p}.indexer.wq_b.weight"].shape == (32 * 128, 128)
    assert tensors[f"{p}.indexer.wk.weight"].shape == (128, 64)
    assert tensors[f"{p}.indexer.weights_proj.weight"].shape == (32, 64)
    assert f"{p}.q_proj.weight" not in tensors
    assert from_hf_config(folder).num_heads == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [({"index_head_dim": 64}, "index-head-dim must be 128"), ({"index_topk": 0}, "index-topk")],
)
def test_bad_sparse_specs_name_the_setting(change, message):
    with pytest.raises(MakeModelError, match=message):
        TinyModelSpec(sparse=True, **change)


HYV4 = TinyModelSpec(
    arch="hy-v4", layers=3, heads=2, hidden=64, intermediate=128, vocab=320, index_topk=16
)


@pytest.fixture(scope="module")
def hyv4(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "hyv4", HYV4)


def _hyv4_names(layers: int, indexed: list[int]) -> set[str]:
    """Every tensor vLLM's HYV4ForCausalLM loads, under the original checkpoint names."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    names |= {f"model.hc_head.hc_head_{n}" for n in ("fn", "base", "scale")}
    for i in range(layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        names |= {f"{p}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        attn = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa")
        attn += ("kv_a_layernorm", "kv_b_proj", "o_proj", "linear_gate")
        names |= {f"{a}.{n}.weight" for n in attn} | {f"{a}.learnable_sink_param"}
        for hc in ("hc_attn_layer", "hc_mlp_layer"):
            names |= {f"{p}.{hc}.hc_pre.hc_{n}" for n in ("fn", "base", "scale")}
        if i in indexed:
            ix = f"{a}.indexer"
            names |= {f"{ix}.{n}.weight" for n in ("wq_b", "wk", "k_norm", "weights_proj")}
            names.add(f"{ix}.k_norm.bias")
        if i == 0:
            names |= {f"{p}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        else:
            m = f"{p}.mlp"
            names |= {f"{m}.gate.weight", f"{m}.gate.e_score_correction_bias"}
            names |= {f"{m}.experts.gate_up_proj", f"{m}.experts.down_proj"}
            names |= {f"{m}.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")}
    return names


def test_hyv4_config_has_what_vllm_and_transformers_read(hyv4):
    config = json.loads((hyv4 / "config.json").read_text())
    assert config["model_type"] == "hy_v4"
    assert config["architectures"] == ["HYV4ForCausalLM"]
    # vLLM's HY-V4 turns these on only where the config says so (transformers always)
    assert config["learnable_sink"] and config["enable_ihc"] and config["gated_mla"]
    assert config["gating_type"] == "elementwise"
    # a DSA layer for vLLM only with an index_topk and one of its sparse layer types
    assert config["layer_types"] == ["indexed_attention"] * 3
    assert config["index_topk"] == 16 and config["index_head_dim"] == 128
    assert config["indexer_types"] == ["full", "full", "shared"]  # HY-V4's pattern
    assert config["mlp_layer_types"] == ["dense", "sparse", "sparse"]
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert (config["qk_nope_head_dim"], config["v_head_dim"]) == (192, 256)
    assert config["n_routed_experts"] == 4 and config["num_experts_per_tok"] == 2
    assert config["num_nextn_predict_layers"] == 0  # vLLM's default (1) drops a layer
    assert config["pad_token_id"] is None  # transformers' default is past this vocabulary
    assert config["rms_norm_eps"] == 1e-6  # the eps both sides hard-code in places
    assert config["swiglu_limit"] >= 100  # vLLM CPU's MoE experts do not clamp
    geo = from_hf_config(hyv4)
    assert (geo.num_heads, geo.kv_lora_rank, geo.qk_rope_head_dim) == (2, 512, 64)
    assert (geo.qk_nope_head_dim, geo.v_head_dim, geo.num_layers) == (192, 256, 3)


def test_hyv4_tensors_are_exactly_what_vllm_loads(hyv4):
    tensors = read(hyv4)
    assert set(tensors) == _hyv4_names(3, indexed=[0, 1])
    a = "model.layers.2.self_attn"
    assert tensors[f"{a}.kv_b_proj.weight"].shape == (2 * (192 + 256), 512)
    assert tensors[f"{a}.q_b_proj.weight"].shape == (2 * (192 + 64), 128)
    assert tensors[f"{a}.linear_gate.weight"].shape == (2 * 256, 64)
    assert tensors[f"{a}.o_proj.weight"].shape == (64, 2 * 256)
    sinks = tensors[f"{a}.learnable_sink_param"]
    assert sinks.shape == (2,) and sinks.dtype == torch.float32
    assert sinks.abs().min() > 0  # a zero sink would still count, but drawn: they differ
    assert not torch.equal(sinks, tensors["model.layers.1.self_attn.learnable_sink_param"])
    m = "model.layers.1.mlp"
    assert tensors[f"{m}.experts.gate_up_proj"].shape == (4, 2 * 32, 64)
    assert tensors[f"{m}.experts.down_proj"].shape == (4, 64, 32)
    assert tensors[f"{m}.gate.weight"].shape == (4, 64)
    p = "model.layers.0.hc_attn_layer.hc_pre"
    assert tensors[f"{p}.hc_fn"].shape == (8, 4 * 64)
    assert tensors[f"{p}.hc_base"].shape == (8,) and tensors[f"{p}.hc_scale"].shape == (2,)
    assert tensors["model.hc_head.hc_head_fn"].shape == (4, 4 * 64)
    assert tensors["model.hc_head.hc_head_scale"].shape == (1,)


def test_hyv4_weights_follow_the_seed_and_the_default_is_unchanged():
    a, b = weights(HYV4, 320), weights(HYV4, 320)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = weights(TinyModelSpec(**{**HYV4.__dict__, "seed": 1}), 320)
    key = "model.layers.0.self_attn.learnable_sink_param"
    assert not torch.equal(a[key], other[key])
    assert TinyModelSpec().arch == "deepseek" and not TinyModelSpec().dsa
    assert "model.layers.0.self_attn.q_proj.weight" in weights(SMALL, 320)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"arch": "hy-v5"}, "--arch must be one of"),
        ({"layers": 1}, "needs --layers >= 2"),
        ({"kv_b_format": "mxfp8"}, "--kv-b-format 'mxfp8' is not made for --arch hy-v4"),
        ({"kv_b_exact": True}, "--kv-b-exact True is not made"),
        ({"mtp_layers": -1}, "--mtp-layers must be >= 0"),
        ({"experts_per_tok": 5}, "--experts-per-tok 5 > --experts 4"),
        ({"hc_mult": 0}, "--hc-mult must be >= 1"),
        ({"index_head_dim": 64}, "index-head-dim must be 128"),
    ],
)
def test_bad_hyv4_specs_name_the_setting(change, message):
    with pytest.raises(MakeModelError, match=message):
        TinyModelSpec(**{"arch": "hy-v4", **change})


def test_hyv4_mtp_layers_add_hyv4s_mtp_names_and_leave_the_model_as_it_is():
    """``mtp_layers`` for HY-V4: ``model.mtp_layers.{j}.`` (vLLM's HYV4MTP names), a MoE
    layer with its own indexer, no iHC, plus enorm / hnorm / eh_proj / final_layernorm;
    drawn last, so every other tensor equals the model's without them."""
    plain = weights(HYV4, 320)
    with_mtp = weights(dataclasses.replace(HYV4, mtp_layers=1), 320)
    extra = set(with_mtp) - set(plain)
    assert set(plain) <= set(with_mtp)
    assert all(torch.equal(plain[k], with_mtp[k]) for k in plain)
    assert extra and all(k.startswith("model.mtp_layers.0.") for k in extra)
    p = "model.mtp_layers.0."
    assert {p + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight")} <= extra
    assert p + "self_attn.indexer.wq_b.weight" in extra and p + "mlp.gate.weight" in extra
    assert not any("hc_" in k for k in extra)
    assert with_mtp[p + "eh_proj.weight"].shape == (HYV4.hidden, 2 * HYV4.hidden)


def test_cli_make_model_hyv4(tmp_path, capsys):
    args = ["make-model", str(tmp_path / "h"), "--arch", "hy-v4", "--hidden", "64"]
    assert main([*args, "--vocab", "320", "--experts", "2", "--experts-per-tok", "1"]) == 0
    assert "HY-V4, DSA top-32" in capsys.readouterr().out
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert (config["n_routed_experts"], config["num_experts_per_tok"]) == (2, 1)
    assert main(["make-model", str(tmp_path / "bad"), "--arch", "hy-v4", "--layers", "1"]) == 2
    assert "needs --layers >= 2" in capsys.readouterr().err


GLM5 = TinyModelSpec(arch="glm5-next", heads=2, hidden=64, intermediate=128, vocab=320)


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "glm5", GLM5)


def test_glm5next_config_has_what_vllm_and_transformers_read(glm5):
    config = json.loads((glm5 / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("glm5_next", ["Glm5NextForCausalLM"])
    # every layer MLA (vLLM CPU has no KDA path), each with its own kpool indexer
    assert config["layer_types"] == ["indexed_attention"] * 2
    assert config["indexer_types"] == ["full"] * 2 and config["mlp_layer_types"] == ["dense"] * 2
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["mla_use_nope"]) == (
        512,
        0,
        True,
    )
    assert (config["qk_nope_head_dim"], config["v_head_dim"]) == (256, 256)
    assert config["index_kpool"] == 16 and config["index_kpool_always_select_tail"]
    assert config["index_topk"] % config["index_kpool"] == 0
    assert not config["mhc"] and config["hc_mult"] == 1  # vLLM CPU's mHC drops a norm
    assert config["torch_dtype"] == "bfloat16"
    geo = from_hf_config(glm5)
    assert (geo.num_heads, geo.kv_lora_rank, geo.qk_rope_head_dim, geo.head_size) == (
        2,
        512,
        0,
        512,
    )


def test_glm5next_tensors_are_exactly_what_vllm_loads_on_the_bf16_grid(glm5):
    tensors = read(glm5)
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        names |= {f"{p}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        names |= {f"{p}.mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        attn = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa")
        names |= {f"{a}.{n}.weight" for n in (*attn, "kv_a_layernorm", "kv_b_proj", "o_proj")}
        ix = f"{a}.indexer"
        names |= {f"{ix}.{n}.weight" for n in ("wq_b", "wk", "k_norm", "weights_proj")}
        names |= {f"{ix}.k_norm.bias", f"{ix}.index_kpool_compress_ape"}
        names.add(f"{ix}.index_kpool_compress_gate")
    assert set(tensors) == names
    a = "model.layers.1.self_attn"
    assert tensors[f"{a}.kv_a_proj_with_mqa.weight"].shape == (512, 64)  # no RoPE rows
    assert tensors[f"{a}.kv_b_proj.weight"].shape == (2 * (256 + 256), 512)
    assert tensors[f"{a}.q_b_proj.weight"].shape == (2 * 256, 128)
    assert tensors[f"{a}.indexer.index_kpool_compress_gate"].shape == (128, 64)
    assert tensors[f"{a}.indexer.index_kpool_compress_ape"].shape == (16, 128)
    for t in tensors.values():  # bf16 values in fp32 tensors: vLLM's bf16 copy is exact
        assert t.dtype == torch.float32 and torch.equal(t, t.to(torch.bfloat16).float())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"index_topk": 40}, "multiple of GLM-5.3-Flash's index_kpool 16"),
        ({"kv_b_format": "mxfp8"}, "--kv-b-format 'mxfp8' is not made for --arch glm5-next"),
        ({"mtp_layers": 1}, "--mtp-layers 1 is not made for --arch glm5-next"),
        ({"index_head_dim": 64}, "index-head-dim must be 128"),
        ({"kda": True, "layers": 3}, "--kda needs --layers >= 4"),
        ({"mhc": True, "hc_mult": 1}, "--mhc needs --hc-mult >= 2, got 1"),
    ],
)
def test_bad_glm5next_specs_name_the_setting(change, message):
    with pytest.raises(MakeModelError, match=message):
        TinyModelSpec(**{"arch": "glm5-next", **change})


@pytest.mark.parametrize("flag", ["kda", "mhc"])
@pytest.mark.parametrize("arch", ["deepseek", "hy-v4"])
def test_kda_and_mhc_are_glm5next_only(arch, flag):
    message = f"--{flag} is made for --arch glm5-next only, not {arch}"
    with pytest.raises(MakeModelError, match=message):
        TinyModelSpec(arch=arch, sparse=arch == "deepseek", **{flag: True})


def test_glm5next_mhc_weights_are_vllms_per_layer_mixing_tensors(tmp_path):
    spec = TinyModelSpec(arch="glm5-next", mhc=True, hidden=64, vocab=320)
    folder = make_model(tmp_path / "mhc", spec)
    config = json.loads((folder / "config.json").read_text())
    assert config["mhc"] and config["hc_mult"] == 4 and config["hc_sinkhorn_iters"] == 20
    tensors = read(folder)
    for i in range(2):
        for block in ("attn", "ffn"):
            p = f"model.layers.{i}.hc_{block}"
            assert tensors[f"{p}_fn"].shape == (24, 4 * 64)  # (2 + n) n mixes of n streams
            assert tensors[f"{p}_base"].shape == (24,) and tensors[f"{p}_scale"].shape == (3,)
    plain = read(make_model(tmp_path / "plain", TinyModelSpec(arch="glm5-next", hidden=64)))
    assert not any(".hc_" in name for name in plain)


def test_glm5next_kda_layers_follow_the_checkpoints_pattern(tmp_path):
    """Every fourth layer MLA (3, 7), the others KDA with the tensors vLLM loads (q/k/v/b/f_a
    /g_a merged, three short convolutions ``[C, 1, W]``, the gate's bias and A_log)."""
    spec = TinyModelSpec(arch="glm5-next", layers=8, kda=True, hidden=64, vocab=320)
    folder = make_model(tmp_path / "kda", spec)
    config = json.loads((folder / "config.json").read_text())
    kinds = ["indexed_attention" if i in (3, 7) else "linear_attention" for i in range(8)]
    assert config["layer_types"] == kinds
    assert (config["linear_num_heads"], config["linear_head_dim"]) == (4, 128)
    tensors = read(folder)
    a = "model.layers.0.self_attn"
    width = 4 * 128
    assert tensors[f"{a}.q_conv1d.weight"].shape == (width, 1, 4)
    assert tensors[f"{a}.A_log"].shape == (4,) and tensors[f"{a}.dt_bias"].shape == (width,)
    assert tensors[f"{a}.f_b_proj.weight"].shape == (width, 128)
    assert not any(n.startswith(f"{a}.indexer") or "kv_b_proj" in n for n in tensors if a in n)
    assert "model.layers.3.self_attn.kv_b_proj.weight" in tensors


def test_cli_make_model_glm5next(tmp_path, capsys):
    args = ["make-model", str(tmp_path / "g"), "--arch", "glm5-next", "--hidden", "64"]
    assert main([*args, "--vocab", "320", "--layers", "1"]) == 0
    assert "GLM-5.3-Flash, DSA top-32 of 32 index heads over pools of 16" in capsys.readouterr().out
    assert json.loads((tmp_path / "g" / "config.json").read_text())["num_hidden_layers"] == 1
    kda = ["make-model", str(tmp_path / "k"), "--arch", "glm5-next", "--hidden", "64", "--kda"]
    assert main([*kda, "--vocab", "320", "--layers", "4"]) == 0
    assert "latent 512 no RoPE, 3 KDA layers" in capsys.readouterr().out


V4 = TinyModelSpec(arch="deepseek-v4", layers=4, heads=2, hidden=64, intermediate=128, vocab=320)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "v4", V4)


def _v4_names(ratios: list[int], experts: int) -> set[str]:
    """Every tensor of a DeepSeek-V4 checkpoint under its original names (what vLLM's
    DeepseekV4ForCausalLM loads as they are), written out from the checkpoint's layout."""
    names = {"embed.weight", "norm.weight", "head.weight"}
    names |= {f"hc_head_{n}" for n in ("fn", "base", "scale")}
    for i, ratio in enumerate(ratios):
        p, a, f = f"layers.{i}", f"layers.{i}.attn", f"layers.{i}.ffn"
        names |= {f"{p}.attn_norm.weight", f"{p}.ffn_norm.weight"}
        names |= {f"{p}.hc_{b}_{n}" for b in ("attn", "ffn") for n in ("fn", "base", "scale")}
        attn = ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")
        names |= {f"{a}.{n}.weight" for n in attn} | {f"{a}.attn_sink"}
        compressors = {4: [f"{a}.compressor", f"{a}.indexer.compressor"], 128: [f"{a}.compressor"]}
        for c in compressors.get(ratio, []):
            names |= {f"{c}.{n}.weight" for n in ("wkv", "wgate", "norm")} | {f"{c}.ape"}
        if ratio == 4:
            names |= {f"{a}.indexer.wq_b.weight", f"{a}.indexer.weights_proj.weight"}
        names |= {f"{f}.gate.weight", f"{f}.gate.tid2eid" if i == 0 else f"{f}.gate.bias"}
        for e in [*(f"experts.{j}" for j in range(experts)), "shared_experts"]:
            names |= {f"{f}.{e}.w{k}.weight" for k in (1, 2, 3)}
    return names


def test_v4_config_has_deepseek_v4s_own_keys(v4):
    config = json.loads((v4 / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (
        "deepseek_v4",
        ["DeepseekV4ForCausalLM"],
    )
    # window-only, C4 (indexed), C128, C4: every layer kind, a C4 before the C128
    assert config["compress_ratios"] == [0, 4, 128, 4]
    assert (config["head_dim"], config["qk_rope_head_dim"], config["index_head_dim"]) == (
        512,
        64,
        128,
    )
    # the expert defaults vLLM CPU's _C routers are built for; one hash-routed layer first
    assert (config["n_routed_experts"], config["num_experts_per_tok"]) == (64, 6)
    assert config["num_hash_layers"] == 1 and config["scoring_func"] == "sqrtsoftplus"
    assert config["sliding_window"] == 128 and config["o_groups"] == 2
    # bf16 weights, no FP8 (vLLM CPU serves FP8 linears only with AMX), no YaRN, no MTP
    assert "quantization_config" not in config and "rope_scaling" not in config
    assert config["num_nextn_predict_layers"] == 0 and config["torch_dtype"] == "bfloat16"


def test_v4_tensors_are_the_original_checkpoint_names_on_the_bf16_grid(v4):
    tensors = read(v4)
    assert set(tensors) == _v4_names([0, 4, 128, 4], 64)
    a = "layers.1.attn"
    assert tensors[f"{a}.wq_b.weight"].shape == (2 * 512, 128)  # heads x 512, q_lora_rank
    assert tensors[f"{a}.wkv.weight"].shape == (512, 64)  # one latent: K and V
    assert tensors[f"{a}.wo_a.weight"].shape == (2 * 64, 2 * 512 // 2)  # groups x rank
    assert tensors[f"{a}.compressor.ape"].shape == (4, 2 * 512)  # C4: overlapping halves
    assert tensors[f"{a}.indexer.compressor.ape"].shape == (4, 2 * 128)
    assert tensors["layers.2.attn.compressor.ape"].shape == (128, 512)  # C128: one series
    assert tensors["layers.0.hc_attn_fn"].shape == (24, 4 * 64)  # (2 + n) n mixes, n = 4
    assert tensors["hc_head_fn"].shape == (4, 4 * 64)
    assert tensors["layers.1.ffn.experts.63.w2.weight"].shape == (64, 32)  # intermediate / 4
    table = tensors["layers.0.ffn.gate.tid2eid"]
    assert table.dtype == torch.int32 and table.shape == (320, 6)
    assert table.min() >= 0 and table.max() < 64
    assert all(len(set(row.tolist())) == 6 for row in table)  # six distinct experts a token
    sinks = tensors[f"{a}.attn_sink"]
    assert sinks.abs().min() > 0 and abs(sinks.mean() - 2.0) < 3  # drawn around sink_logit 2
    for name, t in tensors.items():
        if t.is_floating_point():
            assert t.dtype == torch.float32
            assert torch.equal(t, t.to(torch.bfloat16).float()), name


def test_v4_weights_follow_the_seed():
    first, again = weights(V4, 320), weights(V4, 320)
    other = weights(dataclasses.replace(V4, seed=1), 320)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["layers.1.attn.wkv.weight"], other["layers.1.attn.wkv.weight"])


def test_v4_layer_pattern_grows_by_alternating_c4_and_c128():
    from vllm_mla.tools.tiny_deepseekv4 import compress_ratios

    assert compress_ratios(3) == [0, 4, 128]
    assert compress_ratios(6) == [0, 4, 128, 4, 128, 4]


def test_expert_defaults_follow_the_architecture():
    assert (TinyModelSpec(arch="hy-v4").experts, TinyModelSpec(arch="hy-v4").experts_per_tok) == (
        4,
        2,
    )
    v4 = TinyModelSpec(arch="deepseek-v4")
    assert (v4.experts, v4.experts_per_tok) == (64, 6)
    assert TinyModelSpec(arch="deepseek-v4", experts=128, experts_per_tok=8).experts == 128


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layers": 2}, "needs --layers >= 3 .a window-only, a C4 and a C128 layer., got 2"),
        ({"heads": 3}, "--heads 3 must be a multiple of the output projection's 2 head groups"),
        ({"hc_mult": 1}, "--hc-mult must be >= 2 for deepseek-v4, got 1"),
        ({"window": 0}, "--window must be >= 1, got 0"),
        ({"mtp_layers": 1}, "--mtp-layers 1 is not made for --arch deepseek-v4"),
        ({"kv_b_format": "fp8-block"}, "--kv-b-format 'fp8-block' is not made for --arch"),
        ({"experts_per_tok": 65}, "--experts-per-tok 65 > --experts 64"),
        ({"intermediate": 3}, "--intermediate 3 leaves experts no width"),
    ],
)
def test_bad_v4_specs_name_the_setting(change, message):
    with pytest.raises(MakeModelError, match=message):
        TinyModelSpec(**{"arch": "deepseek-v4", **change})


def test_the_window_is_deepseek_v4s_only():
    with pytest.raises(MakeModelError, match="--window 64 is not made for --arch hy-v4"):
        TinyModelSpec(arch="hy-v4", window=64)


def test_cli_make_model_deepseek_v4(tmp_path, capsys):
    args = ["make-model", str(tmp_path / "v"), "--arch", "deepseek-v4", "--hidden", "64"]
    assert main([*args, "--vocab", "320", "--layers", "3", "--window", "32"]) == 0
    out = capsys.readouterr().out
    assert "DeepSeek-V4: window 32, 1 C4 layers (indexer top-32 of 32 heads), 1 C128" in out
    assert "64 experts" in out
    assert json.loads((tmp_path / "v" / "config.json").read_text())["sliding_window"] == 32
    assert (
        main(["make-model", str(tmp_path / "bad"), "--arch", "deepseek-v4", "--layers", "2"]) == 2
    )
