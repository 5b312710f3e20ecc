"""Patch ``ModelConfig.verify_with_parallel_config``: pad the config where TP does not divide.

Target: ``vllm.config.model.ModelConfig.verify_with_parallel_config(self,
parallel_config)`` (vLLM 0.32, 0.33, 0.34), feature ``tp-pad`` (on with
``VLLM_MLA_TP_PAD=1`` only).
Why: vLLM refuses every tensor-parallel size that does not divide the attention heads
("Total number of attention heads (64) must be divisible by tensor parallel size (6)"),
so 3 or 6 GPUs cannot serve a 64-head model.
How: before the original, ``vllm_mla.tp_pad.plan`` pads the HF text config's heads and
MLP widths (and vLLM's architecture summary of them) to the sizes TP divides, and records
the padding on the HF config (``RECORD``), which travels to every worker with the config;
the target model's config and an MTP draft's each pass here. Nothing changes where TP
divides every width. The checkpoint is zero-padded to match at load (``tp_pad_weights``),
the vocabulary by vLLM's embedding (``tp_pad_vocab``).
Removal: when vLLM pads heads for tensor parallelism itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vllm_mla import tp_pad

logger = logging.getLogger("vllm_mla")
RECORD = "vllm_mla_tp_pad"  # the HF text config attribute holding TPPad.as_record()


def pad_model_config(model_config: object, tp: int) -> tp_pad.TPPad | None:
    """Pad ``model_config`` for ``tp`` in place (once: a padded config is left as it is);
    the padding, or None where TP divides everything."""
    text = model_config.hf_text_config
    if getattr(text, RECORD, None) is not None:
        return tp_pad.TPPad.from_record(getattr(text, RECORD))
    fields = {**text.to_dict(), "architectures": list(model_config.architectures or [])}
    pad = tp_pad.plan(fields, tp)
    if pad is None:
        return None
    arch = model_config.model_arch_config
    for width, (real, padded) in pad.widths.items():
        field = tp_pad.CONFIG_FIELDS.get(width)
        if field is None:
            continue  # derived (shared experts): follows moe_intermediate_size
        setattr(text, field, padded)
        if width == "heads":
            if getattr(text, "num_key_value_heads", None) == real:
                text.num_key_value_heads = padded
            arch.total_num_attention_heads = padded
            if arch.total_num_kv_heads == real:
                arch.total_num_kv_heads = padded
    setattr(text, RECORD, pad.as_record())
    logger.info(
        "vllm-mla: tensor_parallel_size=%d pads %s (VLLM_MLA_TP_PAD=1; padded rows are zero)",
        tp,
        ", ".join(f"{w} {a} -> {b}" for w, (a, b) in pad.widths.items()),
    )
    return pad


def make_verify_with_parallel_config(original: Callable) -> Callable:
    """The replacement for ``ModelConfig.verify_with_parallel_config``."""

    def verify_with_parallel_config(self, parallel_config) -> None:
        pad_model_config(self, int(parallel_config.tensor_parallel_size))
        return original(self, parallel_config)

    return verify_with_parallel_config
