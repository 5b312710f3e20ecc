"""What ``B12X_MLA_SPARSE`` serves, declared once, and the refusal of everything else.

Any other layer configuration fails at start-up naming the setting, never served
differently: at backend selection (``B12XMLASparseBackend.supports_combination``; vLLM's
forced-backend check raises with the reason) and at impl construction (``refuse_layer``:
what the selector is not shown, the layer's sliding window and sinks, and vLLM CPU, whose
selector the plugin routes without validation).

MLA geometry: latent (kv_lora_rank) 512 with qk_rope_head_dim 64 (DeepSeek-V3.2, GLM-5,
HY-V4: head_size 576) or 0 (GLM-5.3-Flash, no RoPE: head_size 512, ``k_pe`` ``[T, 1, 0]``,
its fixed-width fp8_ds_mla / nvfp4_ds_mla records keep 656 / 352 bytes with an unread
rope slot, bf16 records are 512 wide; ``ops.sparse_mla.formats``). Any other latent or
RoPE width is refused.

Top-k buffer width (``topk_buffer_width``): ``index_topk``, or for a kpool-indexer model
(hf ``index_kpool``, GLM-5.3-Flash) what vLLM's glm5next allocates for its shared top-k
buffer, ``round_up(index_topk + index_kpool - 1, 128)``.

Attention sink (HY-V4's learnable per-head logit, ``sinks`` fp32 ``[heads]`` handed to the
impl by ``MLAAttention``): served, as one more term of each head's softmax denominator
(``vllm_mla.ops.sparse_mla``, ``sink=``). Refused, named: a sink model whose layer arrives
without its ``sinks`` (the sink would be dropped: HY-V4 itself only warns where a backend
lacks ``supports_sink``) and a ``sinks`` tensor that is not fp32 ``[heads]``. Under decode
context parallelism the sink is served too (``sink_under_dcp``): the impl gathers the DCP
group's sinks and counts them once in the merged softmax (``impl.dcp_sinks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType

from vllm_mla.formats import LATENT
from vllm_mla.formats import SPARSE_BACKEND as NAME
from vllm_mla.ops.kpool_indexer.reference import buffer_width
from vllm_mla.ops.sparse_mla.formats import KV_FORMATS, ROPES, record_bytes


@dataclass(frozen=True)
class Served:
    """The one layer configuration this backend serves; anything else is refused."""

    latent: int = LATENT  # kv_lora_rank: kv_c, the value / output width
    # qk_rope_head_dim: 64 (DeepSeek-V3.2 / GLM-5 / HY-V4), 0 (GLM-5.3-Flash, no RoPE)
    ropes: tuple[int, ...] = ROPES
    # (kernel cache format, rope, bytes per KV row), one per row of the KV-format table
    # (``KVFormat.summary`` says what each record holds) and RoPE width
    records: tuple[tuple[str, int, int], ...] = tuple(
        (fmt, rope, record_bytes(fmt, rope)) for rope in ROPES for fmt in KV_FORMATS
    )
    num_kv_heads: int = 1  # MQA over the latent
    attn_type: str = AttentionType.DECODER  # decoder self-attention only
    sink: bool = True  # a learnable per-head attention sink (fp32 [heads])
    sink_under_dcp: bool = True  # ... also under decode context parallelism (once)
    sliding_window: bool = False
    alibi: bool = False
    logits_soft_cap: bool = False
    kv_sharing: bool = False
    needs_index_topk: bool = True  # a DSA model: the lightning indexer selects the top-k
    # hf config fields that give every layer a learnable attention sink (HY-V4)
    sink_fields: tuple[str, ...] = ("learnable_sink",)

    @property
    def head_sizes(self) -> tuple[int, ...]:
        """The served head sizes, latent + rope (576 and 512)."""
        return tuple(self.latent + rope for rope in self.ropes)

    def summary(self) -> str:
        latent = self.latent
        geometries = " or ".join(
            f"head_size {latent + r} = kv_lora_rank {latent} + qk_rope_head_dim {r}"
            for r in self.ropes
        )
        records = "; ".join(
            f"rope {rope}: "
            + " or ".join(f"{f} ({n}-byte rows)" for f, r, n in self.records if r == rope)
            for rope in self.ropes
        )
        return (
            f"it serves sparse MLA of a DSA model (hf config index_topk), decoder "
            f"self-attention, {geometries}, KV cache {records}, a per-head attention sink "
            "(fp32 [heads]), under decode context parallelism too; no sliding window, alibi, "
            "logits soft cap or KV sharing"
        )


SERVES = Served()


def geometry_refusal(
    head_size: int, kv_lora_rank: int | None = None, rope: int | None = None
) -> str | None:
    """Why this MLA geometry is not served (None: it is); the ranks where known (a head
    size alone is served when it is one of ``SERVES.head_sizes``)."""
    latent = SERVES.latent if kv_lora_rank is None else kv_lora_rank
    width = head_size - latent if rope is None else rope
    if latent == SERVES.latent and width in SERVES.ropes and head_size == latent + width:
        return None
    if kv_lora_rank is None or rope is None:
        return f"head_size {head_size} (kv_lora_rank + qk_rope_head_dim)"
    return f"head_size {head_size} = kv_lora_rank {kv_lora_rank} + qk_rope_head_dim {rope}"


def topk_buffer_width(hf: object) -> int:
    """Columns of the model's top-k indices buffer: ``index_topk``, or with a kpool
    indexer (hf ``index_kpool``: GLM-5.3-Flash) ``round_up(index_topk + index_kpool - 1,
    128)``, as vLLM's glm5next sizes its shared buffer (``get_sparse_topk_buffer_width``:
    the incomplete trailing pool reserved, sparse-MLA tiles aligned)."""
    topk, kpool = getattr(hf, "index_topk", None), getattr(hf, "index_kpool", None)
    if topk is None:
        raise ValueError(f"{NAME}: the top-k width of a model without hf index_topk")
    if kpool is None:
        return int(topk)
    return buffer_width(int(topk), int(kpool))


def model_has_sink(hf: object) -> bool:
    """Whether the model's hf (text) config gives its layers an attention sink."""
    return any(bool(getattr(hf, field, False)) for field in SERVES.sink_fields)


def sink_refusals(hf: object, dcp_size: int = 1) -> list[str]:
    """The hf config fields that give the model's layers an attention sink this backend
    does not serve (any sink without ``SERVES.sink``; under DCP without
    ``SERVES.sink_under_dcp``)."""
    fields = [field for field in SERVES.sink_fields if bool(getattr(hf, field, False))]
    if SERVES.sink and (dcp_size <= 1 or SERVES.sink_under_dcp):
        return []
    if not SERVES.sink:
        return [f"hf config {field}=True (a learnable attention sink per head)" for field in fields]
    return [
        f"hf config {field}=True with decode_context_parallel_size={dcp_size} (an attention "
        "sink under DCP: vLLM gathers the group's query heads, whose sinks the other ranks "
        "hold; serve it without DCP)"
        for field in fields
    ]


def model_refusals(hf: object, dcp_size: int = 1) -> list[str]:
    """What the model's hf (text) config asks that this backend does not serve
    (``dcp_size``: vLLM's decode_context_parallel_size)."""
    reasons = []
    if SERVES.needs_index_topk and getattr(hf, "index_topk", None) is None:
        reasons.append("a dense MLA model (hf config has no index_topk): needs a DSA model")
    rope, latent = getattr(hf, "qk_rope_head_dim", None), getattr(hf, "kv_lora_rank", None)
    if isinstance(rope, int) and isinstance(latent, int):
        geometry = geometry_refusal(latent + rope, latent, rope)
        if geometry is not None:
            reasons.append(f"hf config {geometry}")
    return reasons + sink_refusals(hf, dcp_size)


def refusal(reasons: list[str], what: str = "this configuration") -> str | None:
    """One message naming the backend, each setting at fault and what is served."""
    if not reasons:
        return None
    return f"{NAME} does not serve {what}: {'; '.join(reasons)} ({SERVES.summary()})"


def _current_hf_config() -> object | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    model = getattr(config, "model_config", None) if config is not None else None
    return getattr(model, "hf_text_config", None) if model is not None else None


def _sinks_refusals(sinks: Any, num_heads: int | None, dcp_size: int) -> list[str]:
    """What is not served about a layer's ``sinks`` (the impl kwarg)."""
    if not SERVES.sink:
        return ["sinks (a per-head attention sink)"]
    if dcp_size > 1 and not SERVES.sink_under_dcp:
        return [
            f"sinks with decode_context_parallel_size={dcp_size} (an attention sink under "
            "DCP: vLLM gathers the group's query heads, whose sinks the other ranks hold)"
        ]
    heads = "heads" if num_heads is None else str(num_heads)
    if (
        not isinstance(sinks, torch.Tensor)
        or sinks.dtype != torch.float32
        or sinks.dim() != 1
        or (num_heads is not None and sinks.shape[0] != num_heads)
    ):
        got = (
            f"{sinks.dtype} {list(sinks.shape)}"
            if isinstance(sinks, torch.Tensor)
            else type(sinks).__name__
        )
        return [f"sinks {got} (the kernel takes an fp32 [{heads}] sink, one logit per head)"]
    return []


def refuse_layer(
    *,
    head_size: int,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    num_kv_heads: int,
    alibi_slopes: Any,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    attn_type: str,
    kv_sharing_target_layer_name: str | None,
    sinks: Any = None,
    num_heads: int | None = None,
    dcp_size: int = 1,
) -> None:
    """Start-up refusal of a layer this backend does not serve (at impl construction,
    with what vLLM hands the impl and the current model's hf config), naming the setting.

    It sees what backend selection may not: the layer's sliding window and sinks (and
    their dtype and shape: fp32 ``[num_heads]``), and on vLLM CPU (whose selector the
    plugin routes to this backend without validation) all. ``dcp_size``: the impl's
    decode_context_parallel_size."""
    reasons = []
    geometry = geometry_refusal(head_size, kv_lora_rank, qk_rope_head_dim)
    if geometry is not None:
        reasons.append(geometry)
    if num_kv_heads != SERVES.num_kv_heads:
        reasons.append(f"num_kv_heads={num_kv_heads} (MLA is MQA over one latent KV head)")
    if attn_type != SERVES.attn_type:
        reasons.append(f"attn_type={attn_type} (decoder self-attention only)")
    if alibi_slopes is not None and not SERVES.alibi:
        reasons.append("alibi_slopes (ALiBi)")
    if sliding_window is not None and not SERVES.sliding_window:
        reasons.append(f"sliding_window={sliding_window}")
    if logits_soft_cap and not SERVES.logits_soft_cap:
        reasons.append(f"logits_soft_cap={logits_soft_cap}")
    if kv_sharing_target_layer_name is not None and not SERVES.kv_sharing:
        reasons.append(f"kv_sharing_target_layer_name={kv_sharing_target_layer_name!r}")
    hf = _current_hf_config()
    if sinks is not None:
        reasons += _sinks_refusals(sinks, num_heads, dcp_size)
    elif hf is not None and model_has_sink(hf):
        # HY-V4 builds its layers without sinks where it found no sink-capable backend,
        # warning only: the sink would be silently dropped
        reasons += sink_refusals(hf, dcp_size) or [
            "a layer without sinks in a model whose hf config gives every layer a "
            "learnable attention sink (the sink would be dropped)"
        ]
    message = refusal(reasons, "this attention layer")
    if message is not None:
        raise NotImplementedError(message)
