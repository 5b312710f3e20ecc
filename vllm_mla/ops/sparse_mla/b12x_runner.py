"""The b12x runner of ``sparse_mla_forward``: our call -> b12x 1.5.1's planned sparse-MLA API.

``install()`` registers :func:`run_b12x` with ``dispatch.register_b12x_runner`` when
``b12x.attention.sparse_mla`` imports (never at package import time: this module imports
no b12x code until a call). It is called by the backend at construction
(``B12XMLASparseImpl.__init__``), as the dispatch module documents.

Mapping (ours -> b12x, ``b12x/attention/sparse_mla/api.py`` ``plan``/``bind``/``run``):

- ``kv_format="fp8_ds_mla"`` (656-byte FlashMLA record: 512 e4m3, four fp32 group-128
  scales, 64 bf16 k_pe) -> ``Caps(model_type=ModelType.GLM_NSA, cache_record_bytes=656,
  kv_dtype=torch.uint8, head_dim=576, v_head_dim=512)``: b12x's GLM_NSA record
  (ARBITRARY_FP32 inline scales, ``traits.py``) is byte-identical. ``page_size`` is
  ``kv_cache.shape[1]``; physical row ``r`` -> page ``r // page_size``, slot
  ``r % page_size``, the page stride taken from ``kv_cache.stride(0)`` by b12x, so a
  cache whose pages interleave with other layers' is addressed in place.
- ``q_nope [T,H,512]``, ``q_pe [T,H,64]`` (strided views) -> ``q`` ``[T,H,576]``: b12x
  needs one contiguous bf16 tensor, so both halves are COPIED into the plan's
  ``q`` buffer on every call (the prepared launch also fixes its vector-load choice from
  the priming q's alignment; the buffer keeps that true).
- ``indices [T,K]`` (physical rows, -1 empty) -> ``selected_indices`` as is (copied into
  the plan's buffer only when not contiguous); b12x masks ``< 0`` like we do.
- ``lengths [T]`` -> ``selected_lengths`` (entries ``j >= selected_lengths[t]`` masked,
  b12x ``reference.py`` ``active_token_counts``); ``lengths=None`` -> a plan-owned
  ``[K] * T`` vector. ``cache_lengths`` gets the same tensor: b12x 1.5.1's sparse-MLA run
  path never reads it (``_preparation._SparseMlaState.run``), bind only checks it is a
  1-D int32 vector of at most ``max_batch`` rows, and our rows carry no per-request
  cache length.
- ``lse`` (natural log) <- ``Caps(return_lse=True, lse_scale="natural")``: b12x's default
  is base 2 (its reference divides by ln 2); asking for natural avoids a rescale.
- ``out`` <- ``out.copy_(output)``: b12x's output is a view into its scratch.
- ``softmax_scale`` -> ``Caps.softmax_scale`` (b12x bakes it into the plan).

Ownership: one b12x plan per ``(device, H, K, token bucket, page_size, scale,
return_lse)``, created on first use outside CUDA-graph capture together with its
scratch (``plan.memory_requirements().scratch_nbytes`` bytes), q buffer and full-length
vector, and primed once at full capacity (rows = bucket, all indices -1) so b12x
resolves its launchers for the largest row count the plan serves. b12x prepares the
plan lazily on that first run (its documented default-configuration path); our
``PreparationSession.prepare`` probes every declared token bucket before capture, so
every plan exists by then. A plan missing during capture raises ``SparseMLANotPrepared``
instead of allocating. The caller's ``scratch`` (sized for the Triton kernel) is not
used by b12x. ``reset()`` drops the plans (b12x keeps its compiled programs).

Not served by b12x 1.5.1, so run by the portable Triton kernel instead (same result
contract): ``kv_format="bf16"`` (b12x has no 576-bf16 record), q not bf16 (its q and
output are bf16), and a softmax scale that is not finite and positive (Caps rejects it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from vllm_mla.ops.sparse_mla import dispatch
from vllm_mla.ops.sparse_mla.kv_format import (
    HEAD_DIM,
    LATENT,
    SparseMLANotPrepared,
    record_bytes,
)

B12X_MODULE = "b12x.attention.sparse_mla"
# Our cache format -> the b12x recipe (ModelType attribute name) with the same bytes.
B12X_RECIPE = {"fp8_ds_mla": "GLM_NSA"}
B12X_Q_DTYPE = torch.bfloat16
B12X_CACHE_DTYPE = torch.uint8
# b12x's split-K decode keeps max_chunks_per_row partial outputs per row; cap the split
# buffers so a prefill-sized bucket does not ask for gigabytes (few splits are needed
# when T alone fills the GPU). 64 is b12x's default and its candidate window is 64.
MAX_CHUNKS_PER_ROW = 64
CANDIDATE_WINDOW = 64
SPLIT_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class PlanKey:
    """What a b12x plan is specialized on (b12x requires these to match at run time)."""

    device: torch.device
    num_heads: int
    topk: int
    rows: int  # token bucket: the plan's max_q_rows
    page_size: int
    softmax_scale: float
    return_lse: bool


@dataclass
class B12XPlanState:
    """A b12x plan and the runner-owned tensors bound to it (all sized for ``key.rows``)."""

    key: PlanKey
    plan: object
    scratch: torch.Tensor  # uint8, b12x's layout; output/lse are views into it
    q: torch.Tensor  # [rows, H, 576] bf16, contiguous
    indices: torch.Tensor  # [rows, K] int32 (non-contiguous live indices are copied here)
    full_lengths: torch.Tensor  # [rows] int32, all K (lengths=None)


_plans: dict[PlanKey, B12XPlanState] = {}


def b12x_module() -> ModuleType | None:
    """``b12x.attention.sparse_mla`` when it imports, else None (same test as dispatch)."""
    return dispatch._b12x_module()


def install() -> bool:
    """Register :func:`run_b12x` when b12x imports; True when registered.

    A no-op (False) without b12x: the registered runner, if any, is left untouched.
    """
    if b12x_module() is None:
        return False
    dispatch.register_b12x_runner(run_b12x)
    return True


def reset() -> None:
    """Forget every cached b12x plan and its tensors (graphs using them must be gone)."""
    _plans.clear()


def token_bucket(num_tokens: int) -> int:
    """The plan capacity serving ``num_tokens`` rows: the next power of two."""
    return 1 << max(0, num_tokens - 1).bit_length()


def unserved_reason(q_nope: torch.Tensor, kv_format: str, softmax_scale: float) -> str | None:
    """Why b12x 1.5.1 cannot run this call (None when it can)."""
    if kv_format not in B12X_RECIPE:
        return f"kv_format {kv_format!r} has no b12x cache layout"
    if q_nope.dtype != B12X_Q_DTYPE:
        return f"q dtype {q_nope.dtype} (b12x takes bf16)"
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        return f"softmax_scale {softmax_scale} (b12x needs finite > 0)"
    return None


def max_chunks_per_row(rows: int, num_heads: int, topk: int) -> int:
    """Split capacity: every candidate window, bounded by ``SPLIT_BUDGET_BYTES``."""
    per_chunk = rows * num_heads * LATENT * B12X_Q_DTYPE.itemsize
    windows = -(-topk // CANDIDATE_WINDOW)
    return max(1, min(MAX_CHUNKS_PER_ROW, windows, SPLIT_BUDGET_BYTES // per_chunk))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _new_plan(module: ModuleType, key: PlanKey, kv_format: str) -> B12XPlanState:
    caps = module.Caps(
        device=key.device,
        num_q_heads=key.num_heads,
        max_q_rows=key.rows,
        max_width=key.topk,
        softmax_scale=key.softmax_scale,
        dtype=B12X_Q_DTYPE,
        kv_dtype=B12X_CACHE_DTYPE,
        head_dim=HEAD_DIM,
        v_head_dim=LATENT,
        model_type=int(getattr(module.ModelType, B12X_RECIPE[kv_format])),
        cache_record_bytes=record_bytes(kv_format),
        mode="decode",  # any H and K; b12x's extend path needs H % 8 == 0, K in 512/1k/2k
        max_batch=key.rows,
        max_chunks_per_row=max_chunks_per_row(key.rows, key.num_heads, key.topk),
        page_size=key.page_size,
        return_lse=key.return_lse,
        lse_scale="natural",
    )
    plan = module.plan(caps)
    nbytes = int(plan.memory_requirements().scratch_nbytes)
    device = key.device
    return B12XPlanState(
        key=key,
        plan=plan,
        scratch=torch.empty(nbytes, dtype=torch.uint8, device=device),
        q=torch.zeros(key.rows, key.num_heads, HEAD_DIM, dtype=B12X_Q_DTYPE, device=device),
        indices=torch.full((key.rows, key.topk), -1, dtype=torch.int32, device=device),
        full_lengths=torch.full((key.rows,), key.topk, dtype=torch.int32, device=device),
    )


def plan_state(
    module: ModuleType, key: PlanKey, kv_format: str, kv_cache: torch.Tensor
) -> B12XPlanState:
    """The cached plan for ``key``; created and primed at full capacity on first use."""
    state = _plans.get(key)
    if state is not None:
        return state
    if _capturing(key.device):
        raise SparseMLANotPrepared(
            f"b12x sparse-MLA plan {key} would be created during CUDA-graph capture; "
            "prepare this token count before capture"
        )
    state = _new_plan(module, key, kv_format)
    # Priming run: all rows, every index -1 (the cache is addressed, never read). b12x
    # resolves a plan's launchers from its first binding, so it must be the largest.
    empty = torch.zeros_like(state.full_lengths)
    _run(module, state, state.q, kv_cache, state.indices, empty)
    _plans[key] = state
    return state


def _run(
    module: ModuleType,
    state: B12XPlanState,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    binding = module.bind(
        state.plan,
        scratch=state.scratch,
        q=q,
        kv_cache=kv_cache,
        selected_indices=indices,
        cache_lengths=lengths,
        selected_lengths=lengths,
    )
    return module.run(binding)


def run_b12x(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    scratch: torch.Tensor | None,
    *,
    softmax_scale: float,
    kv_format: str,
) -> bool:
    """Write ``out`` [T,H,512] (and natural-log ``lse`` [T,H]) for validated arguments;
    False (nothing written) for a call b12x does not serve: the caller runs Triton.

    Same contract as ``sparse_mla_reference``. After a token count's plan exists (see
    the module docstring), a call allocates nothing beyond what b12x itself does.
    """
    if unserved_reason(q_nope, kv_format, softmax_scale) is not None:
        return False
    t, h = q_nope.shape[:2]
    if t == 0:
        return True
    module = b12x_module()
    if module is None:
        raise RuntimeError(f"the b12x runner is registered but {B12X_MODULE} does not import")
    key = PlanKey(
        device=q_nope.device,
        num_heads=h,
        topk=indices.shape[1],
        rows=token_bucket(t),
        page_size=kv_cache.shape[1],
        softmax_scale=float(softmax_scale),
        return_lse=lse is not None,
    )
    state = plan_state(module, key, kv_format, kv_cache)
    q = state.q[:t]  # contiguous: a prefix of rows
    q[..., :LATENT].copy_(q_nope)
    q[..., LATENT:].copy_(q_pe)
    if not indices.is_contiguous():
        indices = state.indices[:t].copy_(indices)
    if lengths is None:
        lengths = state.full_lengths[:t]
    elif not lengths.is_contiguous():
        lengths = lengths.contiguous()
    result = _run(module, state, q, kv_cache, indices, lengths)
    output, b12x_lse = result if isinstance(result, tuple) else (result, None)
    out.copy_(output)  # output is a view into the plan's scratch
    if lse is not None:
        if b12x_lse is None:
            raise RuntimeError("b12x returned no lse although the plan declares return_lse")
        lse.copy_(b12x_lse)  # natural log: the plan asks for lse_scale="natural"
    return True
