"""DeepSeek-V4 on vLLM CPU: torch stand-ins for the Triton kernels its metadata builders
launch, so vLLM CPU's own V4 path runs a step at all.

vLLM CPU has no Triton backend (``HAS_TRITON`` false: ``triton.jit`` is a placeholder), yet
the V4 builders launch Triton kernels on every platform; the first step stops with
``TypeError: 'function' object is not subscriptable``. vLLM's own CPU overrides
(``CpuPlatform.register_triton_kernel_overrides``) cover none of them. Here, through the
same seam (``vllm.triton_utils.dispatcher.register_kernels``), once vLLM imports the V4
CPU model (``register_on_import``; other models' processes never pay for it):

- ``_token_request_mapping_kernel``: each token's request (every V4 step);
- ``ComputePrefillMetadataKernel``: each prefill's window gather length;
- ``CompressedSlotMappingKernel``: each token's compressed-state slot (every compressor),
  the stand-in the kpool indexer registers for GLM-5.3-Flash.

The fourth kernel, the sliding-window indices (``ComputeSWAIndicesAndLensKernel``), is
launched over a grid of ``num_tokens`` programs that ``register_kernels`` does not pass
on, and writes fewer rows than its buffer has; it is replaced at its launcher (patch
``cpu_dsv4_swa_indices``, ``swa_indices_and_lens`` here). The indexer's prefill-chunk
metadata kernel is ``sparse-cpu``'s already (``sparse.cpu``).

vLLM's V4 CPU kernels themselves are in its ``_C`` library only, which vLLM CPU loads on
AVX-512 BF16 hosts; elsewhere ``dsv4_ops`` defines them in torch (all 16 today) when the
model is built (patch ``cpu_dsv4_kernels``), and ``refusal()`` names any still missing,
so the model stops at construction instead of at its first kernel call.
"""

from __future__ import annotations

import logging

import torch

from vllm_mla.vllm import on_import
from vllm_mla.vllm.sparse import dsv4_ops, kernel_targets, kpool_indexer

logger = logging.getLogger("vllm_mla")
MODEL_MODULE = "vllm.models.deepseek_v4.cpu.model"  # imported when a V4 model loads on CPU
TOKEN_REQUEST_KERNEL = "vllm.v1.attention.ops.metadata._token_request_mapping_kernel"
PREFILL_KERNEL = "vllm.v1.attention.backends.mla.sparse_swa.ComputePrefillMetadataKernel.kernel"
SLOT_KERNEL = "vllm.v1.attention.backends.mla.compressor_utils.CompressedSlotMappingKernel.kernel"


def token_request_mapping(*args, **kwargs) -> None:
    """The kernel's output: token ``t`` < ``num_tokens`` maps to the request whose query
    span holds it (the number of requests ending at or before ``t``, at most the last
    request), or 0 at or past ``num_mapped``."""
    a = kernel_targets.launch_arguments(TOKEN_REQUEST_KERNEL, args, kwargs)
    starts, out = a["query_start_loc"], a["output"]
    reqs, mapped, tokens = int(a["num_reqs"]), int(a["num_mapped"]), int(a["num_tokens"])
    token = torch.arange(tokens, device=out.device)
    ends = starts[1 : reqs + 1].to(token.dtype)
    req = torch.searchsorted(ends, token, right=True).clamp_max(reqs - 1)
    out[:tokens] = torch.where(token < mapped, req, 0).to(out.dtype)


def prefill_gather_lengths(*args, **kwargs) -> None:
    """The kernel's output: per prefill (after the ``num_decodes`` decodes), its query
    length plus the part of its prefix still in the window (``window_size - 1`` at most,
    none below the request's replay start)."""
    a = kernel_targets.launch_arguments(PREFILL_KERNEL, args, kwargs)
    first, count = int(a["num_decodes"]), int(a["num_prefills"])
    rows = slice(first, first + count)
    starts = a["query_start_loc_ptr"]
    query = starts[first + 1 : first + count + 1] - starts[rows]
    visible = (a["seq_lens_ptr"][rows] - query - a["replay_start_ptr"][rows]).clamp_min(0)
    out = a["prefill_gather_lens_ptr"]
    out[:count] = (query + visible.clamp_max(int(a["window_size"]) - 1)).to(out.dtype)


def swa_indices_and_lens(
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    window_size: int,
    index_width: int,
    left_visible: torch.Tensor,
    right_visible: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    replay_start: torch.Tensor,
    *,
    num_tokens: int,
    token_offset: int,
    has_image: bool = False,
) -> None:
    """What ``ComputeSWAIndicesAndLensKernel`` writes for rows ``[0, num_tokens)``
    (tokens ``token_offset + row``): the window's length (0 for a padded token) and its
    KV slots (``block * block_size + offset`` through the request's block table) in the
    first ``index_width`` columns, -1 past the window. The window ends at the token's
    position (plus ``right_visible`` with an image) and starts ``window_size - 1`` before
    it (widened by ``left_visible``), never before 0 or the request's replay start."""
    if num_tokens <= 0:
        return
    dev = swa_lens.device
    token = torch.arange(num_tokens, device=dev) + token_offset
    valid = is_valid_token[token].bool()
    req = token_to_req_indices[token].long()
    q0 = query_start_loc[req].long()
    query = query_start_loc[req + 1].long() - q0
    pos = seq_lens[req].long() - query + token - q0
    left = left_visible[token].long() if has_image else torch.zeros_like(pos)
    right = right_visible[token].long() if has_image else torch.zeros_like(pos)
    start = (pos - (window_size - 1) - (left - (window_size - 1)).clamp_min(0)).clamp_min(0)
    start = torch.maximum(start, replay_start[req].long())
    length = pos + right + 1 - start
    swa_lens[:num_tokens] = torch.where(valid, length, 0).to(swa_lens.dtype)
    column = torch.arange(index_width, device=dev)
    inside = (column < length[:, None]) & valid[:, None]
    at = start[:, None] + column
    table = block_table.reshape(block_table.shape[0], -1)
    blocks = table[req[:, None], (at // block_size).clamp(0, table.shape[1] - 1)].long()
    slots = torch.where(inside, blocks * block_size + at % block_size, -1)
    rows = swa_indices.view(swa_indices.shape[0], -1)
    rows[:num_tokens, :index_width] = slots.to(rows.dtype)


STAND_INS = (
    kernel_targets.StandIn(
        kernel=TOKEN_REQUEST_KERNEL,
        impl=token_request_mapping,
        why="every V4 metadata build maps tokens to requests (compute_token_to_req_indices) "
        "with this Triton kernel on every platform",
        how="searchsorted over the requests' query ends, the kernel's clamp and its 0 past "
        "num_mapped",
        removal="when vLLM CPU registers a torch compute_token_to_req_indices",
    ),
    kernel_targets.StandIn(
        kernel=PREFILL_KERNEL,
        impl=prefill_gather_lengths,
        why="the V4 sliding-window builder sizes each prefill's window gather with this "
        "Triton kernel on every platform",
        how="query length + min(prefix past the replay start, window - 1), per prefill",
        removal="when vLLM CPU registers a torch ComputePrefillMetadataKernel",
    ),
    kernel_targets.StandIn(
        kernel=SLOT_KERNEL,
        impl=kpool_indexer.compressed_slot_mapping_kernel,
        why="V4's compressors map each token to its compressed-state slot "
        "(get_compressed_slot_mapping) with this Triton kernel on every platform",
        how="the kpool indexer's stand-in: the state slot of the window a token completes",
        removal="when vLLM registers a CPU CompressedSlotMappingKernel",
    ),
)

_registered: str | None = None


def missing_kernels() -> list[str]:
    """vLLM CPU's V4 kernels neither its loaded library nor our torch ops provide (ours
    defined first where the library lacks them: ``dsv4_ops.register``)."""
    dsv4_ops.register()
    return dsv4_ops.missing()


def refusal() -> str | None:
    """Why vLLM CPU cannot serve DeepSeek-V4 in this process (None: it can)."""
    missing = missing_kernels()
    if not missing:
        return None
    from vllm_mla.vllm import cpu_host

    host = cpu_host.describe()
    loaded = ", ".join(host["loaded_libraries"]) or host["expected_library"]
    return (
        f"DeepSeek-V4 is not served on this host: vLLM CPU's V4 kernels are in its _C "
        f"library only, which it loads on AVX-512 BF16 hosts; this process loads {loaded} "
        f"(VLLM_MLA_CPU_ISA={host['isa']}), and of the {len(dsv4_ops.OPS)} kernels torch "
        f"serves {len(dsv4_ops.OPS) - len(missing)} so far; missing: {', '.join(missing)}"
    )


def register() -> str:
    """``STAND_INS`` through ``register_kernels`` (once; CPU without Triton)."""
    global _registered
    if _registered is None:
        ran = kernel_targets.register_stand_ins(STAND_INS)
        _registered = (
            "DeepSeek-V4 metadata kernels (token requests, prefill window lengths, "
            "compressed slots) in torch (register_kernels)"
            if ran
            else "DeepSeek-V4 metadata kernels: vLLM's Triton runs here"
        )
    return _registered


def register_on_import() -> str:
    """``register`` when vLLM imports its V4 CPU model (now if it already has)."""

    def _register(module: object) -> None:
        logger.info("vllm-mla: %s", register())

    if on_import.when_imported(MODEL_MODULE, _register):
        return register()
    return f"DeepSeek-V4 metadata kernels: registered when {MODEL_MODULE} is imported"
