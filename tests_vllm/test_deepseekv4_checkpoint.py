"""The tiny DeepSeek-V4 checkpoint (``make-model --arch deepseek-v4``) as transformers'
``DeepseekV4ForCausalLM`` loads it, in every installed transformers: no missing, unexpected
or mismatched key, every layer kind built, and the original names landing where
DeepSeek-V4's checkpoints put them (per-expert ``w1`` / ``w3`` stacked gate first)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from vllm_mla.tools.tinymodel import TinyModelSpec, make_model

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)

SPEC = TinyModelSpec(arch="deepseek-v4", heads=2, hidden=64, intermediate=128, vocab=320)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = make_model(tmp_path_factory.mktemp("v4") / "tiny", SPEC)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    return model, info, load_file(folder / "model.safetensors")


def test_transformers_loads_every_tensor(loaded):
    model, info, _ = loaded
    assert type(model).__name__ == "DeepseekV4ForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected, mismatched key, no error


def test_every_layer_kind_is_built(loaded):
    model, _, _ = loaded
    assert model.config.layer_types == [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]
    assert model.config.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert model.config.sliding_window == SPEC.window
    assert model.config.hc_mult == SPEC.hc_mult


def test_the_original_names_land_on_their_parameters(loaded):
    model, _, ckpt = loaded
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    layer = "model.layers.1"
    experts = torch.stack(
        [
            torch.cat(
                [
                    ckpt[f"layers.1.ffn.experts.{e}.w1.weight"],
                    ckpt[f"layers.1.ffn.experts.{e}.w3.weight"],
                ]
            )
            for e in range(SPEC.experts)
        ]
    )
    pairs = {
        f"{layer}.mlp.experts.gate_up_proj": experts,
        f"{layer}.self_attn.sinks": ckpt["layers.1.attn.attn_sink"],
        f"{layer}.self_attn.kv_proj.weight": ckpt["layers.1.attn.wkv.weight"],
        f"{layer}.self_attn.compressor.position_bias": ckpt["layers.1.attn.compressor.ape"],
        f"{layer}.self_attn.compressor.indexer.position_bias": ckpt[
            "layers.1.attn.indexer.compressor.ape"
        ],
        "model.layers.0.mlp.gate.tid2eid": ckpt["layers.0.ffn.gate.tid2eid"],
        "model.hc_head.hc_fn": ckpt["hc_head_fn"],
        "lm_head.weight": ckpt["head.weight"],
    }
    for name, expected in pairs.items():
        assert torch.equal(params[name].to(expected.dtype), expected), name
