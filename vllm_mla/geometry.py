"""MLA geometry: the sizes that fix every absorbed-weight shape, and TP sharding.

Symbols follow vLLM: N heads, P = qk_nope_head_dim, R = qk_rope_head_dim,
L = kv_lora_rank, V = v_head_dim. kv_b_proj is ``[N * (P + V), L]``; the absorbed
pair is ``W_UK_T [N, P, L]`` and ``W_UV [N, L, V]``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from vllm_mla.formats import MX_BLOCK  # L must split into whole MXFP8 scale blocks


class GeometryError(ValueError):
    """A geometry or sharding that cannot work; the message names the field."""


@dataclass(frozen=True)
class MLAGeometry:
    """Model-level MLA sizes (all heads, before tensor parallelism)."""

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    kv_lora_rank: int
    v_head_dim: int
    num_layers: int
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in (
            "num_heads",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "kv_lora_rank",
            "v_head_dim",
            "num_layers",
        ):
            value = getattr(self, field)
            # MLA without RoPE (GLM-5.3-Flash) has qk_rope_head_dim 0; every other size is
            # a count of at least one
            least = 0 if field == "qk_rope_head_dim" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                kind = "a non-negative" if least == 0 else "a positive"
                raise GeometryError(f"{field} must be {kind} int, got {value!r}")
        if self.kv_lora_rank % MX_BLOCK:
            raise GeometryError(
                f"kv_lora_rank must be a multiple of {MX_BLOCK} (MXFP8 block), "
                f"got {self.kv_lora_rank}"
            )

    @property
    def head_size(self) -> int:
        """Width of a latent query/KV row: L + R (576 for every preset; 512 without RoPE)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def shard(self, tp: int, rank: int = 0) -> RankGeometry:
        """Heads held by ``rank`` of ``tp``; pads with zero heads when tp does not divide N."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
            raise GeometryError(f"tp must be a positive int, got {tp!r}")
        if tp > self.num_heads:
            raise GeometryError(
                f"tp={tp} exceeds num_heads={self.num_heads}: some rank would hold no real head"
            )
        if not 0 <= rank < tp:
            raise GeometryError(f"rank must be in [0, {tp}), got {rank}")
        per_rank = math.ceil(self.num_heads / tp)
        first = rank * per_rank
        real = max(0, min(per_rank, self.num_heads - first))
        return RankGeometry(self, tp=tp, rank=rank, num_heads=per_rank, real_heads=real)


@dataclass(frozen=True)
class RankGeometry:
    """What one TP rank holds: ``num_heads`` heads, of which ``real_heads`` are real.

    Padded heads (``num_heads - real_heads``, always the last ones) have all-zero
    weights, as vLLM's padded "virtual TP" does (64 heads at TP6 -> 11 per rank).
    """

    model: MLAGeometry
    tp: int
    rank: int
    num_heads: int
    real_heads: int

    @property
    def first_head(self) -> int:
        """Global index of this rank's first head."""
        return self.rank * self.num_heads

    @property
    def padded_heads(self) -> int:
        return self.num_heads - self.real_heads

    @property
    def kv_b_rows(self) -> int:
        """Output rows of this rank's kv_b_proj: N * (P + V)."""
        return self.num_heads * (self.model.qk_nope_head_dim + self.model.v_head_dim)

    @property
    def w_uk_t_shape(self) -> tuple[int, int, int]:
        m = self.model
        return (self.num_heads, m.qk_nope_head_dim, m.kv_lora_rank)

    @property
    def w_uv_shape(self) -> tuple[int, int, int]:
        m = self.model
        return (self.num_heads, m.kv_lora_rank, m.v_head_dim)


PRESETS: dict[str, MLAGeometry] = {
    "deepseek-v3": MLAGeometry(128, 128, 64, 512, 128, 61, name="deepseek-v3"),
    "glm-5": MLAGeometry(64, 192, 64, 512, 256, 78, name="glm-5"),
    "kimi-k2": MLAGeometry(64, 128, 64, 512, 128, 61, name="kimi-k2"),
    "deepseek-v2-lite": MLAGeometry(16, 128, 64, 512, 128, 27, name="deepseek-v2-lite"),
}


HF_FIELDS = {
    "num_heads": "num_attention_heads",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "kv_lora_rank": "kv_lora_rank",
    "v_head_dim": "v_head_dim",
    "num_layers": "num_hidden_layers",
}


def from_hf_config(path: str | Path) -> MLAGeometry:
    """The geometry in a model folder's (or file's) transformers ``config.json``."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise GeometryError(f"{file}: not a readable config.json ({exc})") from None
    # a multimodal checkpoint (GLM-5.3-Flash's Glm5NextForConditionalGeneration) nests
    # the language model's fields
    config = config.get("text_config") or config
    missing = [key for key in HF_FIELDS.values() if key not in config]
    if missing:
        raise GeometryError(f"{file}: not an MLA config, missing {', '.join(missing)}")
    name = path.name if path.is_dir() else path.parent.name
    return MLAGeometry(**{f: config[key] for f, key in HF_FIELDS.items()}, name=name)


def preset(name: str) -> MLAGeometry:
    """The named preset; an unknown name is a GeometryError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(sorted(PRESETS))
        raise GeometryError(f"unknown preset {name!r} (known: {known})") from None
