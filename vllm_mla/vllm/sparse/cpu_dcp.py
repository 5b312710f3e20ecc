"""Decode context parallelism on vLLM CPU: torch stand-ins for the two vLLM kernels DCP
runs that vLLM CPU (no Triton) cannot.

- ``ComputeSlotMappingKernel`` (``vllm.v1.worker.block_table``): vLLM CPU registers a C++
  implementation that asserts "Context Parallelism is not supported on CPU." for a DCP
  group; ours computes the DCP slots (a position another rank holds gets ``PAD_ID``)
  and hands every other launch to vLLM's own (``vllm.utils.cpu_triton_utils``).
- ``CorrectAttnCPOutKernel`` (``vllm.v1.attention.ops.dcp``, the LSE correction of the
  ``ag_rs`` combine, ``cp_lse_ag_out_rs``): Triton only. Its launcher also reads
  ``len(kernel.constexprs)``, which a kernel override (and vLLM's Triton placeholder)
  does not have, so the override is given the kernel's constexpr positions.

Both go through vLLM's extension API (``vllm.triton_utils.dispatcher.register_kernels``),
installed by ``B12XMLASparseImpl`` when it is built with a DCP group on a CPU platform
without Triton: that is after vLLM's worker registered its own CPU kernels (a plugin
loads before that, and vLLM's registration would replace ours). Once per process. A
kernel the installed vLLM does not have is not overridden, and the outcome names it:
vLLM 0.34 has no ``ComputeSlotMappingKernel`` (x86 CPUs run its GPU model runner, whose
block table computes slots in Triton, with triton-cpu).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("vllm_mla")
SLOT_KERNEL = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"
COMBINE_KERNEL = "vllm.v1.attention.ops.dcp.CorrectAttnCPOutKernel.kernel"
_installed: str | None = None


def compute_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc_ptr: torch.Tensor,
    positions_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    slot_mapping_ptr: torch.Tensor,
    KV_CACHE_BLOCK_SIZE: int,  # the kernel's own parameter names: launches bind by name
    TOTAL_CP_WORLD_SIZE: int,
    TOTAL_CP_RANK: int,
    CP_KV_CACHE_INTERLEAVE_SIZE: int,
    PAD_ID: int,
    BLOCK_SIZE: int,
) -> None:
    """The kernel's output, in torch: the slot of every scheduled token (``PAD_ID`` for a
    position another context-parallel rank holds, and past ``num_tokens``). Without
    context parallelism: vLLM CPU's own implementation."""
    if TOTAL_CP_WORLD_SIZE == 1:
        from vllm.utils import cpu_triton_utils

        cpu_triton_utils._compute_slot_mapping_kernel_impl(
            num_tokens,
            max_num_tokens,
            query_start_loc_ptr,
            positions_ptr,
            block_table_ptr,
            block_table_stride,
            slot_mapping_ptr,
            KV_CACHE_BLOCK_SIZE,
            TOTAL_CP_WORLD_SIZE,
            TOTAL_CP_RANK,
            CP_KV_CACHE_INTERLEAVE_SIZE,
            PAD_ID,
            BLOCK_SIZE,
        )
        return
    n, i, bs = TOTAL_CP_WORLD_SIZE, CP_KV_CACHE_INTERLEAVE_SIZE, KV_CACHE_BLOCK_SIZE
    starts = query_start_loc_ptr.long()
    lengths = starts[1:] - starts[:-1]
    request = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[:num_tokens]
    pos = positions_ptr[: request.numel()].long()
    virtual_block, offset = pos.div(bs * n, rounding_mode="floor"), pos.remainder(bs * n)
    held = offset.div(i, rounding_mode="floor").remainder(n) == TOTAL_CP_RANK
    local = offset.div(n * i, rounding_mode="floor") * i + offset.remainder(i)
    table = block_table_ptr.reshape(-1, block_table_stride)
    block = table[request, virtual_block.clamp(max=block_table_stride - 1)].long()
    slots = torch.where(held, block * bs + local, PAD_ID)
    slot_mapping_ptr[: slots.numel()] = slots.to(slot_mapping_ptr.dtype)
    slot_mapping_ptr[slots.numel() : max_num_tokens] = PAD_ID


def correct_attn_cp_out(
    outputs_ptr: torch.Tensor,
    new_output_ptr: torch.Tensor,
    lses_ptr: torch.Tensor,
    vlse_ptr: torch.Tensor,
    outputs_stride_B: int,
    outputs_stride_H: int,
    outputs_stride_D: int,
    lses_stride_N: int,
    lses_stride_B: int,
    lses_stride_H: int,
    lse_idx: int,
    HEAD_DIM: int,
    N_ROUNDED: int,
    IS_BASE_E: bool,
) -> None:
    """The kernel's outputs, in torch, from the tensors it is given (``outputs [B, H, D]``,
    ``lses [N, B, H]`` all ranks' LSEs): ``vlse [B, H]`` = the merged LSE, and
    ``new_output`` = ``outputs`` x (base)^(this rank's lse - merged lse), 0 where that
    weight is 0. NaN or +inf LSEs count as -inf, as in the kernel."""
    lses = lses_ptr.float()
    lses = torch.where(lses.isnan() | (lses == float("inf")), float("-inf"), lses)
    peak = lses.max(dim=0).values
    peak = torch.where(peak == float("-inf"), 0.0, peak)
    exp, log = (torch.exp, torch.log) if IS_BASE_E else (torch.exp2, torch.log2)
    merged = log(exp(lses - peak).sum(dim=0)) + peak
    vlse_ptr.copy_(merged.to(vlse_ptr.dtype))
    mine = lses[lse_idx] - merged
    mine = torch.where(mine.isnan() | (mine == float("inf")), float("-inf"), mine)
    factor = exp(mine)[..., None]
    corrected = torch.where(factor == 0.0, 0.0, outputs_ptr.float() * factor)
    new_output_ptr.copy_(corrected.to(new_output_ptr.dtype))


def install() -> str:
    """Register both stand-ins (once per process, CPU without Triton); what happened."""
    global _installed
    if _installed is not None:
        return _installed
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        _installed = "DCP: vLLM's Triton kernels run here"
        return _installed
    from vllm.v1.attention.ops import dcp

    from vllm_mla.vllm.sparse.kernel_targets import constexpr_positions, kernel_at, register

    stand_ins = {SLOT_KERNEL: compute_slot_mapping, COMBINE_KERNEL: correct_attn_cp_out}
    absent = [name for name in stand_ins if kernel_at(name) is None]
    constexprs = constexpr_positions(dcp.CorrectAttnCPOutKernel.kernel)
    register({k: v for k, v in stand_ins.items() if k not in absent})
    # the launcher counts its regular arguments as len(arg_names) - len(constexprs)
    dcp.CorrectAttnCPOutKernel.kernel.constexprs = constexprs
    _installed = "DCP LSE correction in torch (register_kernels)"
    if SLOT_KERNEL not in absent:
        _installed = "DCP slot mapping and LSE correction in torch (register_kernels)"
    if absent:
        _installed += f"; not in this vLLM, so not overridden: {', '.join(absent)}"
    logger.info("vllm-mla: %s", _installed)
    return _installed


__all__ = ["compute_slot_mapping", "correct_attn_cp_out", "install"]
