"""Patch vLLM 0.32's DeepSeek-V4 CPU weight loading so ``reload_weights`` serves the new sink.

Target: ``vllm.models.deepseek_v4.cpu.model.DeepseekV4Model.load_weights(self, weights)``
(vLLM 0.32; 0.33 and 0.34 build the sink with ``make_attention_sink``, whose weight loader
reload wraps), feature ``lifecycle``, CPU platform only, applied when that module is
imported.
Why: it copies each layer's ``attn_sink`` shard straight into the parameter
(``params_dict[name][:n].copy_``), past any ``weight_loader``, as HY-V4's did: vLLM's
layerwise reload counts nothing loaded there and puts the old sink back, so a reloaded
engine serves the new checkpoint with the old sinks (seen on the tiny V4: greedy tokens
neither checkpoint's).
How: the sink entries are held back and loaded through the parameter's ``weight_loader``
(``hyv4_sink_reload.sinks_through_their_loader``: the original's head-shard copy on first
load, counted and copied into the same storage on reload).
Removal: with vLLM 0.32.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.vllm.patches.hyv4_sink_reload import sinks_through_their_loader

SINK = "attn_sink"


def make_load_weights(original: Callable) -> Callable:
    """The replacement for ``DeepseekV4Model.load_weights``."""
    return sinks_through_their_loader(original, SINK)
