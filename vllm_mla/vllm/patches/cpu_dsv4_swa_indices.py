"""Patch DeepSeek-V4's sliding-window indices launcher on CPU to run without Triton.

Target: ``vllm.v1.attention.backends.mla.sparse_swa.ComputeSWAIndicesAndLensKernel.__call__
(self, swa_indices, swa_lens, window_size, index_width, left_visible, right_visible,
query_start_loc, seq_lens, token_to_req_indices, is_valid_token, block_table, block_size,
replay_start, *, num_tokens, token_offset, has_image=False)`` (vLLM 0.32, 0.33, 0.34),
feature ``sparse-cpu``, CPU platform only, applied when that module is imported.
Why: the V4 sliding-window metadata builder launches this Triton kernel on every platform,
and vLLM CPU has no Triton backend (the first V4 step stops with ``'function' object is
not subscriptable``). ``register_kernels`` cannot stand in for it: the launch grid
(``num_tokens`` programs, fewer than the decode buffer's rows) is not passed to a stand-in.
How: CPU tensors go to ``sparse.dsv4_cpu.swa_indices_and_lens`` (the kernel's rows in
torch; telemetry ``dsv4:swa-indices:cpu``) where Triton cannot run; the rest to the
original.
Removal: when vLLM CPU serves ``ComputeSWAIndicesAndLensKernel`` without Triton.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_mla.vllm import telemetry


def make_call(original: Callable) -> Callable:
    """The replacement for ``ComputeSWAIndicesAndLensKernel.__call__``."""
    from vllm.triton_utils import HAS_TRITON

    from vllm_mla.vllm.sparse.dsv4_cpu import swa_indices_and_lens

    def __call__(self, swa_indices, *args, **kwargs):
        if HAS_TRITON or swa_indices.device.type != "cpu":
            return original(self, swa_indices, *args, **kwargs)
        telemetry.record_sparse("dsv4:swa-indices:cpu")
        return swa_indices_and_lens(swa_indices, *args, **kwargs)

    return __call__
