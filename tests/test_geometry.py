import json

import pytest

from vllm_mla.geometry import PRESETS, GeometryError, MLAGeometry, from_hf_config, preset


@pytest.mark.parametrize(
    ("name", "heads", "p", "v", "layers"),
    [
        ("deepseek-v3", 128, 128, 128, 61),
        ("glm-5", 64, 192, 256, 78),
        ("kimi-k2", 64, 128, 128, 61),
        ("deepseek-v2-lite", 16, 128, 128, 27),
    ],
)
def test_presets_match_the_reference_table(name, heads, p, v, layers):
    g = preset(name)
    assert (g.num_heads, g.qk_nope_head_dim, g.v_head_dim, g.num_layers) == (heads, p, v, layers)
    assert (g.qk_rope_head_dim, g.kv_lora_rank, g.head_size) == (64, 512, 576)


def test_even_sharding():
    r = preset("glm-5").shard(4, rank=3)
    assert (r.num_heads, r.real_heads, r.first_head) == (16, 16, 48)
    assert r.kv_b_rows == 16 * (192 + 256)
    assert r.w_uk_t_shape == (16, 192, 512) and r.w_uv_shape == (16, 512, 256)


def test_padded_heads_go_to_the_last_rank():
    g = preset("kimi-k2")
    ranks = [g.shard(6, rank=r) for r in range(6)]
    assert {r.num_heads for r in ranks} == {11}
    assert [r.real_heads for r in ranks] == [11, 11, 11, 11, 11, 9]
    assert sum(r.real_heads for r in ranks) == 64 and ranks[-1].padded_heads == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_heads": 0}, "num_heads"),
        ({"qk_nope_head_dim": -1}, "qk_nope_head_dim"),
        ({"v_head_dim": 0}, "v_head_dim"),
        ({"num_layers": 0}, "num_layers"),
        ({"kv_lora_rank": 500}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 1.5}, "qk_rope_head_dim"),
        ({"qk_rope_head_dim": -1}, "qk_rope_head_dim"),
    ],
)
def test_invalid_geometry_names_the_field(kwargs, field):
    args = {
        "num_heads": 8,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "kv_lora_rank": 512,
        "v_head_dim": 128,
        "num_layers": 2,
    }
    with pytest.raises(GeometryError, match=field):
        MLAGeometry(**{**args, **kwargs})


@pytest.mark.parametrize(("tp", "rank", "match"), [(0, 0, "tp"), (65, 0, "tp=65"), (4, 4, "rank")])
def test_invalid_sharding(tp, rank, match):
    with pytest.raises(GeometryError, match=match):
        preset("glm-5").shard(tp, rank)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(GeometryError, match="deepseek-v3"):
        preset("llama")
    assert set(PRESETS) == {"deepseek-v3", "glm-5", "kimi-k2", "deepseek-v2-lite"}


def test_mla_without_rope_is_a_geometry(tmp_path):
    """GLM-5.3-Flash: qk_rope_head_dim 0 (latent rows of 512); a multimodal checkpoint's
    fields are read from its text_config."""
    geo = MLAGeometry(64, 256, 0, 512, 256, 11, name="glm-5.3-flash")
    assert geo.head_size == 512 and geo.shard(8).w_uk_t_shape == (8, 256, 512)
    text = {"num_attention_heads": 8, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0}
    text |= {"kv_lora_rank": 512, "v_head_dim": 256, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    assert from_hf_config(tmp_path).head_size == 512
