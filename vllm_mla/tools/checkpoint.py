"""Read kv_b_proj tensors of a real model from safetensors files (never pickle).

Keys look like ``model.layers.{i}.self_attn.kv_b_proj.weight`` with, for quantized
checkpoints, ``weight_scale_inv`` (block FP8) or ``weight_scale`` (MXFP8) beside it.
Each layer is sliced to one TP rank's heads (zero heads appended when padded).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from vllm_mla.formats import FP8_BLOCK
from vllm_mla.geometry import RankGeometry
from vllm_mla.quant import mxfp8

KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.kv_b_proj\.(weight|weight_scale_inv|weight_scale)$"
)


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the message names the file or tensor at fault."""


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted(path.glob("*.safetensors"))
        if found:
            return found
        raise CheckpointError(f"no *.safetensors files in {path}")
    raise CheckpointError(f"checkpoint path does not exist: {path}")


def checkpoint_format(tensors: dict[str, torch.Tensor]) -> str:
    """'fp8-block', 'mxfp8', or the dense dtype ('bf16', 'fp16', 'fp32') of the tensors present."""
    if "weight_scale_inv" in tensors:
        return "fp8-block"
    if "weight_scale" in tensors:
        return "mxfp8"
    dtype = tensors["weight"].dtype
    return {torch.float32: "fp32", torch.float16: "fp16"}.get(dtype, "bf16")


def load_kv_b_proj(
    path: str | Path, geo: RankGeometry, max_layers: int | None = None
) -> list[dict[str, torch.Tensor]]:
    """Per layer (in layer order), rank ``geo``'s kv_b_proj tensors, on CPU.

    Raises CheckpointError for a missing path, no kv_b_proj tensors, a shape that
    does not match the geometry, or MXFP8 scales holding NaN (255) blocks.
    """
    found: dict[int, dict[str, tuple[Path, str]]] = {}
    for file in _files(Path(path)):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    m = KEY.search(key)
                    if m:
                        found.setdefault(int(m.group(1)), {})[m.group(2)] = (file, key)
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None
    if not found:
        raise CheckpointError(f"{path}: no '...layers.N.self_attn.kv_b_proj.weight' tensors")
    layers = sorted(found)[:max_layers]
    return [_read_layer(found[i], geo) for i in layers]


def _read_layer(entries: dict[str, tuple[Path, str]], geo: RankGeometry) -> dict:
    if "weight" not in entries:
        names = [k for _, k in entries.values()]
        raise CheckpointError(f"kv_b_proj weight missing beside {names}")
    tensors = {}
    for name, (file, key) in entries.items():
        with safe_open(file, framework="pt") as f:
            tensors[name] = (f.get_tensor(key), key)
    weight, weight_key = tensors["weight"]
    m = geo.model
    expected = (m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    if tuple(weight.shape) != expected:
        raise CheckpointError(
            f"{weight_key}: shape {tuple(weight.shape)} does not match preset {m.name}: "
            f"expected {expected}"
        )
    if "weight_scale" in tensors:
        scales, key = tensors["weight_scale"]
        if scales.dtype != torch.uint8:
            scales = scales.view(torch.uint8)
        nan_blocks = mxfp8.count_nan_blocks(scales)
        if nan_blocks:
            raise CheckpointError(
                f"{key}: {nan_blocks} MXFP8 block(s) have scale 255 (NaN); refusing to load "
                "NaN weights"
            )
        tensors["weight_scale"] = (scales, key)
    return {name: _shard(t, name, key, geo) for name, (t, key) in tensors.items()}


def _shard(tensor: torch.Tensor, name: str, key: str, geo: RankGeometry) -> torch.Tensor:
    """Rows of ``tensor`` for rank ``geo``, zero rows appended for padded heads."""
    per_head = geo.model.qk_nope_head_dim + geo.model.v_head_dim
    start, rows = geo.first_head * per_head, geo.real_heads * per_head
    total = geo.kv_b_rows
    if name == "weight_scale_inv":
        if start % FP8_BLOCK or (rows % FP8_BLOCK and rows != total):
            raise CheckpointError(
                f"{key}: rank {geo.rank} of tp={geo.tp} starts or ends inside a "
                f"{FP8_BLOCK}-row FP8 block (rows {start}..{start + rows})"
            )
        start, rows, total = start // FP8_BLOCK, -(-rows // FP8_BLOCK), -(-total // FP8_BLOCK)
    part = tensor[start : start + rows]
    if part.shape[0] == total:
        return part.contiguous()
    pad_value = 1.0 if name == "weight_scale_inv" else 0
    pad = torch.full((total - part.shape[0], *part.shape[1:]), pad_value, dtype=torch.float32)
    return torch.cat([part, pad.to(part.dtype)])
