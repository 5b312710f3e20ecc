"""Patch DeepSeek-V4's CPU sliding-window builder to name every layer type's scheduler.

Target: ``vllm.models.deepseek_v4.cpu.cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
.build_tile_scheduler(self, num_decode_tokens)`` (vLLM 0.32, 0.33, 0.34), feature
``sparse-cpu``, CPU platform only, applied when that module is imported.
Why: it returns schedulers for the ``swaonly`` / ``c4a`` / ``c128a`` layer types only,
while the shared ``DeepseekSparseSWAMetadataBuilder.build`` also reads ``c1a`` and ``c2a``:
every V4 step on vLLM CPU stops with ``KeyError: 'c1a'``.
How: the original's schedulers, with ``None`` (CPU runs no tile scheduler, as the
original's own entries say) for each ``_LAYER_TYPE_*`` of the shared builder's module it
leaves out.
Removal: when vLLM's CPU builder returns every layer type the shared builder reads.
"""

from __future__ import annotations

from collections.abc import Callable

SHARED_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"


def layer_types() -> tuple[str, ...]:
    """Every layer type the shared builder schedules (its ``_LAYER_TYPE_*`` constants)."""
    import importlib

    shared = importlib.import_module(SHARED_MODULE)
    return tuple(v for k, v in vars(shared).items() if k.startswith("_LAYER_TYPE_"))


def make_build_tile_scheduler(original: Callable) -> Callable:
    """The replacement for ``build_tile_scheduler``."""
    names = layer_types()

    def build_tile_scheduler(self, num_decode_tokens):
        return dict.fromkeys(names) | dict(original(self, num_decode_tokens))

    return build_tile_scheduler
