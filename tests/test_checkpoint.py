"""Reading kv_b_proj from safetensors: formats, TP slicing, padding, poisoned scales."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from vllm_mla.geometry import MLAGeometry
from vllm_mla.tools.checkpoint import CheckpointError, checkpoint_format, load_kv_b_proj
from vllm_mla.tools.standins import checkpoint_tensors

MODEL = MLAGeometry(4, 64, 16, 64, 64, 2, name="tiny")  # 128 rows per head: FP8 blocks align


def full_weight(layer: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(layer)
    return torch.randn(MODEL.num_heads * 128, MODEL.kv_lora_rank, generator=gen)


def write(path, fmt, layers=2, extra=None):
    tensors = {"model.embed_tokens.weight": torch.zeros(4, 4)}
    for i in range(layers):
        for name, t in checkpoint_tensors(full_weight(i), fmt).items():
            tensors[f"model.layers.{i}.self_attn.kv_b_proj.{name}"] = t.contiguous()
    tensors.update(extra or {})
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block", "mxfp8"])
def test_reads_every_layer_in_its_format(tmp_path, fmt):
    write(tmp_path / "model-00001.safetensors", fmt)
    layers = load_kv_b_proj(tmp_path, MODEL.shard(1))
    assert len(layers) == 2 and checkpoint_format(layers[0]) == fmt
    assert torch.equal(
        layers[1]["weight"].view(torch.uint8),
        checkpoint_tensors(full_weight(1), fmt)["weight"].view(torch.uint8),
    )


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block", "mxfp8"])
def test_tp_slices_heads_and_pads_the_last_rank(tmp_path, fmt):
    path = write(tmp_path / "m.safetensors", fmt, layers=1)
    full = checkpoint_tensors(full_weight(0), fmt)
    geo = MODEL.shard(3, rank=1)  # 2 heads per rank; rank 1: heads 2, 3
    rank1 = load_kv_b_proj(path, geo)[0]
    assert torch.equal(rank1["weight"].view(torch.uint8), full["weight"][256:512].view(torch.uint8))
    rank2 = load_kv_b_proj(path, MODEL.shard(3, rank=2))[0]  # heads 4, 5: both padding
    assert rank2["weight"].shape == (256, 64)
    assert rank2["weight"].view(torch.uint8).eq(0).all()


def test_padded_heads_are_zero(tmp_path):
    model = MLAGeometry(3, 64, 16, 64, 64, 1, name="odd")
    save_file(
        {"layers.0.self_attn.kv_b_proj.weight": torch.ones(3 * 128, 64, dtype=torch.bfloat16)},
        str(tmp_path / "m.safetensors"),
    )
    rank1 = load_kv_b_proj(tmp_path, model.shard(2, rank=1))[0]["weight"]
    assert rank1.shape == (256, 64)
    assert rank1[:128].eq(1).all() and rank1[128:].eq(0).all()


def test_layers_limit(tmp_path):
    write(tmp_path / "m.safetensors", "mxfp8", layers=2)
    assert len(load_kv_b_proj(tmp_path, MODEL.shard(1), max_layers=1)) == 1


def test_nan_scales_are_reported_with_tensor_name_and_count(tmp_path):
    bad = checkpoint_tensors(full_weight(0), "mxfp8")
    bad["weight_scale"][3, :2] = 255
    bad["weight_scale"][7, 0] = 255
    save_file(
        {f"model.layers.0.self_attn.kv_b_proj.{k}": v for k, v in bad.items()},
        str(tmp_path / "m.safetensors"),
    )
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.kv_b_proj\.weight_scale: 3 "):
        load_kv_b_proj(tmp_path, MODEL.shard(1))


def test_shape_mismatch_names_the_tensor(tmp_path):
    path = write(tmp_path / "m.safetensors", "bf16", layers=1)
    wrong = MLAGeometry(8, 64, 16, 64, 64, 1, name="wrong")
    with pytest.raises(
        CheckpointError, match=r"kv_b_proj\.weight: shape \(512, 64\).*\(1024, 64\)"
    ):
        load_kv_b_proj(path, wrong.shard(1))


def test_fp8_block_split_inside_a_block_is_refused(tmp_path):
    model = MLAGeometry(4, 32, 16, 64, 32, 1, name="narrow")  # 64 rows per head
    save_file(
        {
            f"layers.0.self_attn.kv_b_proj.{k}": v
            for k, v in checkpoint_tensors(torch.randn(256, 64), "fp8-block").items()
        },
        str(tmp_path / "m.safetensors"),
    )
    with pytest.raises(CheckpointError, match="inside a 128-row FP8 block"):
        load_kv_b_proj(tmp_path, model.shard(4, rank=1))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: p / "missing", "does not exist"),
        (lambda p: p, "no \\*.safetensors"),
        (lambda p: (p / "x.safetensors").write_bytes(b"not safetensors") and p, "not a readable"),
        (lambda p: save_file({"a": torch.zeros(1)}, str(p / "a.safetensors")) or p, "no '"),
    ],
)
def test_unusable_paths(tmp_path, make, match):
    with pytest.raises(CheckpointError, match=match):
        load_kv_b_proj(make(tmp_path), MODEL.shard(1))
