"""Head-padded tensor parallelism: the padded widths of a model at a TP size its heads (or
MLP widths) do not divide, and the checkpoint tensors zero-padded to them.

Plan -> pad: ``plan(config, tp)`` reads an HF config (attribute or mapping access) and
returns the ``TPPad`` (None when TP divides every width: nothing changes); ``pad_tensor``
zero-pads one checkpoint tensor by its name (``RULES``: one table, which tensor, which
dimension, which width). Padded units are inert by construction:

- heads: zero ``q_b_proj``/``q_proj`` rows give the head a zero query, zero
  ``kv_b_proj`` rows make its absorbed ``W_UK = W_UV = 0``, so its attention output is
  exactly 0 whatever it attends to; zero ``o_proj`` columns add exactly 0 to the hidden
  state;
- MLP widths (dense ``intermediate_size``, expert ``moe_intermediate_size``, the shared
  experts' ``moe_intermediate_size * n_shared_experts``): zero gate/up rows give
  ``silu(0) * 0 = 0``, zero down columns add 0.

The vocabulary is padded by vLLM's own embedding (``padded_vocab``: to a multiple of
``lcm(pad_to, tp)``, the logits cut back to the real vocabulary). No vLLM import here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

WIDTHS = ("heads", "intermediate", "moe_intermediate", "shared_intermediate")
# (name pattern, dimension, width): the one table of what padding touches. A tensor whose
# name matches is padded along that dimension from the width's real size to its padded
# size (its scales too, by the same ratio: whole quantization blocks or an error).
RULES: tuple[tuple[str, int, str], ...] = (
    (r"self_attn\.(q_b_proj|q_proj|kv_b_proj)\.", 0, "heads"),
    (r"self_attn\.o_proj\.", 1, "heads"),
    (r"mlp\.experts\.\d+\.(gate_proj|up_proj)\.", 0, "moe_intermediate"),
    (r"mlp\.experts\.\d+\.down_proj\.", 1, "moe_intermediate"),
    (r"mlp\.shared_experts\.(gate_proj|up_proj)\.", 0, "shared_intermediate"),
    (r"mlp\.shared_experts\.down_proj\.", 1, "shared_intermediate"),
    (r"mlp\.(gate_proj|up_proj)\.", 0, "intermediate"),
    (r"mlp\.down_proj\.", 1, "intermediate"),
)
_RULES = tuple((re.compile(p), dim, width) for p, dim, width in RULES)
# architectures whose modules these rules describe (DeepSeek-V2 attention and MLPs)
ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "DeepSeekMTPModel",
    "DeepseekV32MTPModel",
)
# config field of each width (shared: moe_intermediate_size x n_shared_experts)
CONFIG_FIELDS = {
    "heads": "num_attention_heads",
    "intermediate": "intermediate_size",
    "moe_intermediate": "moe_intermediate_size",
}


class TPPadError(ValueError):
    """A model or tensor head padding cannot serve; the message names it."""


@dataclass(frozen=True)
class TPPad:
    """The padded widths at ``tp``: ``widths[w] = (real, padded)`` for each width padded."""

    tp: int
    widths: dict[str, tuple[int, int]]

    def padded(self, width: str) -> int | None:
        """The padded size of ``width`` (None: not padded)."""
        return self.widths[width][1] if width in self.widths else None

    def as_record(self) -> dict:
        """JSON-able (it travels on the HF config to every worker)."""
        return {"tp": self.tp, "widths": {k: list(v) for k, v in self.widths.items()}}

    @classmethod
    def from_record(cls, record: Mapping) -> TPPad:
        widths = {k: (int(a), int(b)) for k, (a, b) in record["widths"].items()}
        return cls(int(record["tp"]), widths)


def _get(config: object, name: str, default: object = None) -> object:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def granularity(config: object) -> int:
    """Rows a rank's MLP width must be a multiple of: the quantization block (fp8 block
    ``weight_block_size``, a group size), 1 unquantized; an error for an unknown layout."""
    quant = _get(config, "quantization_config")
    if not quant:
        return 1
    block = _get(quant, "weight_block_size")
    if block:
        return int(block[0])
    group = _get(quant, "group_size")
    if group:
        return int(group)
    raise TPPadError(
        f"VLLM_MLA_TP_PAD: quantization_config {dict(quant)!r} states no block or group "
        "size, so the padded MLP widths cannot be aligned to it"
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan(config: object, tp: int) -> TPPad | None:
    """The widths ``tp`` does not divide, padded (heads to a multiple of ``tp``, MLP widths
    to a multiple of ``tp`` x the quantization block); None when it divides them all."""
    if tp <= 1:
        return None
    archs = list(_get(config, "architectures") or [])
    widths: dict[str, tuple[int, int]] = {}
    heads = int(_get(config, "num_attention_heads"))
    if heads % tp:
        widths["heads"] = (heads, _round_up(heads, tp))
    g = granularity(config)
    for width in ("intermediate", "moe_intermediate"):
        real = _get(config, CONFIG_FIELDS[width])
        if real and int(real) % (tp * g):
            widths[width] = (int(real), _round_up(int(real), tp * g))
    shared = int(_get(config, "n_shared_experts") or 0)
    if "moe_intermediate" in widths and shared:
        real, padded = widths["moe_intermediate"]
        widths["shared_intermediate"] = (real * shared, padded * shared)
    if not widths:
        return None
    if not any(a in ARCHITECTURES for a in archs):
        raise TPPadError(
            f"VLLM_MLA_TP_PAD: architecture {archs} has no padding rules (served: "
            f"{', '.join(ARCHITECTURES)}); tensor_parallel_size={tp} does not divide "
            + ", ".join(f"{w} ({real})" for w, (real, _) in widths.items())
        )
    return TPPad(tp, widths)


def rule_of(name: str) -> tuple[int, str] | None:
    """(dimension, width) that ``RULES`` gives a checkpoint tensor name (None: untouched)."""
    for pattern, dim, width in _RULES:
        if pattern.search(name):
            return dim, width
    return None


def pad_tensor(name: str, tensor: torch.Tensor, pad: TPPad) -> torch.Tensor:
    """``tensor`` zero-padded along its rule's dimension from the real width to the padded
    one (a scale by the same ratio); unchanged when no rule or no padded width applies, or
    the dimension is a broadcast 1. Raises ``TPPadError`` naming the tensor when the
    ratio does not give whole rows (a quantization block that straddles the padding)."""
    rule = rule_of(name)
    if rule is None or rule[1] not in pad.widths or tensor.dim() <= rule[0]:
        return tensor
    dim, width = rule
    size = tensor.shape[dim]
    if size == 1:
        return tensor
    real, padded = pad.widths[width]
    if (size * padded) % real:
        raise TPPadError(
            f"VLLM_MLA_TP_PAD: {name} {tuple(tensor.shape)} {tensor.dtype}: dimension {dim} "
            f"({size}) cannot grow by {width} {real} -> {padded} in whole rows"
        )
    grown = size * padded // real
    shape = list(tensor.shape)
    shape[dim] = grown - size
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def padded_vocab(padded_by_vllm: int, pad_to: int, tp: int) -> int:
    """vLLM's padded vocabulary size, grown to a multiple of ``lcm(pad_to, tp)`` where
    ``tp`` does not divide it (unchanged where it does)."""
    if tp <= 1 or padded_by_vllm % tp == 0:
        return padded_by_vllm
    return _round_up(padded_by_vllm, math.lcm(pad_to, tp))


def padding_bytes(pad: TPPad, config: object, bytes_per_weight: float) -> int:
    """Bytes the padded rows and columns add over the whole model at ``bytes_per_weight``
    (all ranks together): heads' q/kv_b rows and o_proj columns per layer, the MLPs'."""
    hidden = int(_get(config, "hidden_size"))
    layers = int(_get(config, "num_hidden_layers"))
    total = 0
    if "heads" in pad.widths:
        real, padded = pad.widths["heads"]
        nope, rope = int(_get(config, "qk_nope_head_dim")), int(_get(config, "qk_rope_head_dim"))
        v, rank = int(_get(config, "v_head_dim")), int(_get(config, "kv_lora_rank"))
        q_in = int(_get(config, "q_lora_rank") or hidden)
        per_head = q_in * (nope + rope) + rank * (nope + v) + v * hidden
        total += (padded - real) * per_head * layers
    dense = min(int(_get(config, "first_k_dense_replace") or 0), layers)
    experts = int(_get(config, "n_routed_experts") or 0)
    per_row = 3 * hidden  # gate, up rows and the down column of one MLP row
    if "intermediate" in pad.widths:
        real, padded = pad.widths["intermediate"]
        total += (padded - real) * per_row * (dense if experts else layers)
    if "moe_intermediate" in pad.widths and experts:
        real, padded = pad.widths["moe_intermediate"]
        total += (padded - real) * per_row * experts * (layers - dense)
    if "shared_intermediate" in pad.widths and experts:
        real, padded = pad.widths["shared_intermediate"]
        total += (padded - real) * per_row * (layers - dense)
    return int(total * bytes_per_weight)
