"""Patch DeepSeek-V3.2's fused norm/RoPE so B12X_MLA_SPARSE writes nvfp4_ds_mla records
with this project's writer.

Target: ``vllm.models.deepseek_v32.attention.fused_norm_rope`` (the name the CUDA DSA
attention, ``DeepseekV32Attention.forward``, calls; vLLM 0.32, 0.33, 0.34), feature
``sparse``, applied when that module is imported.
Why: with ``mla_kv_cache`` passed it also writes the MLA cache, and for nvfp4_ds_mla its
Triton writer uses ``cvt.rn.satfinite.e2m1x2`` (SM100a/SM120a PTX only), so on SM80,
SM89 and SM90 the first forward fails to compile.
How: while a B12X_MLA_SPARSE layer serves nvfp4_ds_mla in this process (``serve()``,
called by the impl), a call for an nvfp4_ds_mla cache runs the original without the
cache (dtype ``auto``, so no nvfp4 code is traced), then writes ``kv_c_out`` / ``k_pe_out``
(normed, RoPE'd: what the original would have cached; the model always passes them) at
``slot_mapping`` with ``ops.sparse_mla.write_records``. Every other call goes to the
original untouched.
Removal: when upstream's nvfp4 writer runs without FP4 PTX.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.ops.sparse_mla import write_records
from vllm_mla.vllm import telemetry

FORMAT = "nvfp4_ds_mla"
_serving = False


def serve(on: bool = True) -> None:
    """Mark that a B12X_MLA_SPARSE layer of this process reads nvfp4_ds_mla records."""
    global _serving
    _serving = on


def make_fused_norm_rope(original: Callable) -> Callable:
    """The replacement for ``deepseek_v32.attention.fused_norm_rope``."""

    def fused_norm_rope(*args, **kwargs):
        cache = kwargs.get("mla_kv_cache")
        if not _serving or cache is None or kwargs.get("mla_kv_cache_dtype") != FORMAT:
            return original(*args, **kwargs)
        kv_c, k_pe = kwargs.get("kv_c_out"), kwargs.get("k_pe_out")
        slots = kwargs.get("slot_mapping")
        if kv_c is None or k_pe is None or slots is None:  # not how the model calls it
            return original(*args, **kwargs)
        kwargs.update(mla_kv_cache=None, mla_kv_cache_dtype="auto", mla_k_scale=None)
        q_c = original(*args, **kwargs)
        write_records(kv_c, k_pe, cache, slots, FORMAT)
        telemetry.record_sparse(f"kv_write:{FORMAT}:fused_norm_rope")
        return q_c

    return fused_norm_rope
