"""The b12x runner of ``sparse_mla_forward``: our call -> b12x 1.5.1's planned sparse-MLA API.

``install()`` registers :func:`run_b12x` with ``dispatch.register_b12x_runner`` when
``b12x.attention.sparse_mla`` imports (never at package import time: this module imports
no b12x code until a call). It is called by the backend at construction
(``B12XMLASparseImpl.__init__``), as ``dispatch`` documents. The b12x names it uses are
declared once (``B12X_FUNCTIONS``, ``B12X_CAPS_FIELDS``, ``B12X_MODEL_TYPES``,
``B12X_PLAN_SCRATCH``): tests_vllm/test_b12x_signatures.py checks them against the
installed b12x and tests/test_sparse_mla_b12x_runner.py builds its fake b12x from them.

Mapping (ours -> b12x, ``b12x/attention/sparse_mla/api.py`` ``plan``/``bind``/``run``;
file:line citations are to the b12x that .venv-vllm installs):

- ``kv_format="fp8_ds_mla"`` (656-byte FlashMLA record: 512 e4m3, four fp32 group-128
  scales, 64 bf16 k_pe) -> ``Caps(model_type=ModelType.GLM_NSA, cache_record_bytes=656,
  kv_dtype=torch.uint8, head_dim=576, v_head_dim=512)``: b12x's GLM_NSA record
  (ARBITRARY_FP32 inline scales, ``traits.py``) is byte-identical. ``page_size`` is
  ``kv_cache.shape[1]``; physical row ``r`` -> page ``r // page_size``, slot
  ``r % page_size``, the page stride taken from ``kv_cache.stride(0)`` by b12x, so a
  cache whose pages interleave with other layers' is addressed in place.
- ``q_nope [T,H,512]``, ``q_pe [T,H,64]`` -> ``q [T,H,576]``. b12x takes one contiguous
  bf16 tensor (``_scratch.py:299`` ``_validate_q``: "q must be contiguous"), and its
  prepared launch fixes 16-byte q loads from the priming q (``kernel.py:2714``
  ``vector_q``) and replays that choice without rechecking the live q
  (``kernel.py:3314`` ``vector_q_override=prepared.vector_q``). So: when q_nope and
  q_pe are the two halves of one contiguous, 16-byte aligned ``[T,H,576]`` tensor
  (a fused q split by ``validate``), that tensor is passed as is, NO copy
  (:func:`fused_q`). Otherwise (vLLM 0.33 hands ``(mqa_ql_nope, mqa_q_pe)`` as two
  tensors) both halves are COPIED into the plan's ``q`` buffer: b12x has no two-pointer
  q.
- ``indices [T,K]`` (physical rows, -1 empty) -> ``selected_indices``: COPIED into the
  plan's ``indices`` buffer with every entry ``>= rows`` of the cache set to -1
  (``formats.INDEX_RULE``: an out-of-pool index is an empty slot; b12x masks ``< 0``
  like we do but does not bound-check the top, so without this it would read past the
  cache). Three small device ops (compare, copy, masked fill) into plan-owned buffers:
  nothing is allocated.
- ``lengths [T]`` -> ``selected_lengths`` (entries ``j >= selected_lengths[t]`` masked,
  b12x ``reference.py`` ``active_token_counts``); COPIED into the plan's ``lengths``
  buffer only when not contiguous (``_scratch.py:355``, ``_validate_i32_vector``).
  ``lengths=None`` -> the plan's ``lengths`` buffer, REWRITTEN (``fill_(K)``) on every
  call that uses it, so no buffer content has to survive anything between calls (vLLM
  sleep level 2 discards this memory; a captured graph replays the fill). The buffer
  itself is needed because b12x takes no "all K" default (``bind`` requires
  ``selected_lengths``). ``cache_lengths`` gets the same tensor: b12x's sparse-MLA run
  path never reads it (``_preparation._SparseMlaState.run``), bind only checks it is a
  1-D contiguous int32 vector of at most ``max_batch`` rows, and our rows carry no
  per-request cache length.
- ``lse`` (natural log) <- ``Caps(return_lse=True, lse_scale="natural")``: b12x's default
  is base 2 (its reference divides by ln 2); asking for natural avoids a rescale.
- ``out`` <- ``out.copy_(output)`` and ``lse.copy_(b12x_lse)``, the two copies b12x
  forces: ``run(binding)`` (``api.py:121``) takes no output, and
  ``_SparseMlaState.run`` (``_preparation.py:274``) calls ``run_prepared_unified_decode``
  without ``out=``, so ``run_unified_decode`` returns
  ``workspace.output_buffer.as_strided(...)`` (``kernel.py:3248``), a view of
  ``tmp_output[:, :, 0, :]`` in the plan scratch (``_scratch.py:472``, chunk-major
  strides, so no caller tensor can stand in for it through ``scratch=`` either); the
  lse is ``workspace.final_lse`` (``_shared/mla/api.py`` ``_final_lse_from_split_workspace``).
- ``softmax_scale`` -> ``Caps.softmax_scale`` (b12x bakes it into the plan).

Ownership: one b12x plan per ``(device, kv_format, H, K, rows, page_size, scale,
return_lse)`` with ``rows`` EXACTLY the token count it was first called with, created
outside CUDA-graph capture before :func:`freeze` together with its scratch
(``plan.memory_requirements().scratch_nbytes`` bytes), q, index and lengths buffers,
and primed once at full capacity (rows = T, all indices -1, lengths 0) so b12x resolves
its launchers for that row count. b12x prepares the plan lazily on that first run (its
documented default-configuration path). ``PreparationSession.prepare`` probes exactly
the sizes ``SparseMLACaps.buckets()`` names, so those are the planned sizes, and
``PreparationSession.freeze()`` calls :func:`freeze`. From then on nothing is planned
or allocated: a T without its own plan is served by the smallest planned ``rows >= T``
of the same key (b12x runs the first T rows of a larger plan: ``bind``/``run`` take
``rows <= max_q_rows``), and raises ``SparseMLANotPrepared`` when no planned size is
that large. During CUDA-graph capture (frozen or not) only a T planned exactly is
served; any other T raises ``SparseMLANotPrepared`` (capture sizes are exactly what
preparation probes, so a miss is a preparation bug, never a reason to allocate).
The caller's ``scratch`` (sized for the Triton kernel) is not used by b12x. ``reset()``
drops the plans and the freeze (b12x keeps its compiled programs).

Not served by b12x 1.5.1, so run by the portable Triton kernel instead (same result
contract): ``kv_format="bf16"`` (b12x has no 576-bf16 record), q not bf16 (its q and
output are bf16), a softmax scale that is not finite and positive (Caps rejects it),
a call passing an ``invalid`` counter (``formats.INDEX_RULE``: b12x masks indices
``< 0`` but counts nothing), and a call passing an attention ``sink`` (HY-V4's: b12x's
``Caps`` and ``bind`` take none). Each such reason is logged once per process.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from types import ModuleType

import torch

from vllm_mla.ops.capture import capturing
from vllm_mla.ops.sparse_mla import dispatch
from vllm_mla.ops.sparse_mla.formats import (
    HEAD_DIM,
    KV_FORMAT_TABLE,
    LATENT,
    ROPE,
    SparseMLANotPrepared,
    cache_rows,
    record_bytes,
)

logger = logging.getLogger("vllm_mla")

# the b12x release this runner's surface was read from (the test environment installs it)
B12X_VERSION = "1.5.1"
B12X_MODULE = "b12x.attention.sparse_mla"
# Our cache format -> the b12x recipe (ModelType attribute name) with the same bytes,
# from the KV-format table (a format without one, bf16 or nvfp4_ds_mla, is declined).
B12X_RECIPE = {f.name: f.b12x_recipe for f in KV_FORMAT_TABLE if f.b12x_recipe is not None}
B12X_Q_DTYPE = torch.bfloat16
B12X_CACHE_DTYPE = torch.uint8
# b12x's prepared launch uses 16-byte q loads when its priming q allowed them
# (kernel.py:2714); a q passed without a copy must be aligned like the plan's buffer.
B12X_Q_ALIGN = 16
# b12x's split-K decode keeps max_chunks_per_row partial outputs per row; cap the split
# buffers so a prefill-sized plan does not ask for gigabytes (few splits are needed
# when T alone fills the GPU). 64 is b12x's default and its candidate window is 64.
MAX_CHUNKS_PER_ROW = 64
CANDIDATE_WINDOW = 64
SPLIT_BUDGET_BYTES = 256 << 20

# -- the b12x surface this module (and dispatch._b12x_usable) relies on ------------------
# Function of ``b12x.attention.sparse_mla`` -> (the positional parameters it is called
# with, the keyword parameters it is called with).
B12X_FUNCTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "plan": (("caps",), ()),
    "bind": (
        ("plan",),
        ("scratch", "q", "kv_cache", "selected_indices", "cache_lengths", "selected_lengths"),
    ),
    "run": (("binding",), ()),
    "is_supported": (("device",), ()),  # called by dispatch._b12x_usable
}
# The ``Caps`` keywords :func:`caps_fields` passes (all of them, nothing else).
B12X_CAPS_FIELDS = (
    "device",
    "num_q_heads",
    "max_q_rows",
    "max_width",
    "softmax_scale",
    "dtype",
    "kv_dtype",
    "head_dim",
    "v_head_dim",
    "model_type",
    "cache_record_bytes",
    "mode",
    "max_batch",
    "max_chunks_per_row",
    "page_size",
    "return_lse",
    "lse_scale",
)
# ``ModelType`` members read (one per served cache format).
B12X_MODEL_TYPES = tuple(sorted(set(B12X_RECIPE.values())))
# ``plan(caps).memory_requirements().scratch_nbytes``: the plan method, then the field.
B12X_PLAN_SCRATCH = ("memory_requirements", "scratch_nbytes")


@dataclass(frozen=True)
class PlanKey:
    """What a b12x plan is specialized on (b12x requires these to match at run time)."""

    device: torch.device
    kv_format: str
    num_heads: int
    topk: int
    rows: int  # the plan's max_q_rows: the token count it was planned for
    page_size: int
    softmax_scale: float
    return_lse: bool


@dataclass
class B12XPlanState:
    """A b12x plan and the runner-owned tensors bound to it (all sized for ``key.rows``).

    None of their contents has to survive between calls: every call writes the part of
    ``q``, ``indices`` and ``lengths`` it passes to b12x before b12x reads it.
    """

    key: PlanKey
    plan: object
    scratch: torch.Tensor  # uint8, b12x's layout; output/lse are views into it
    q: torch.Tensor  # [rows, H, 576] bf16: q_nope/q_pe copied here unless fused_q serves
    indices: torch.Tensor  # [rows, K] int32: the call's indices, out-of-pool -> -1
    outside: torch.Tensor  # [rows, K] bool: which of them were >= the cache's rows
    lengths: torch.Tensor  # [rows] int32: all K (lengths=None) or a non-contiguous copy


_plans: dict[PlanKey, B12XPlanState] = {}
_frozen: set[torch.device | None] = set()  # None: every device
_declined: set[str] = set()  # the decline reasons logged so far (each logged once)


def b12x_module() -> ModuleType | None:
    """``b12x.attention.sparse_mla`` when it imports, else None (same test as ``dispatch``)."""
    return dispatch._b12x_module()


def install() -> bool:
    """Register :func:`run_b12x` when b12x imports; True when registered.

    A no-op (False) without b12x: the registered runner, if any, is left untouched.
    """
    if b12x_module() is None:
        return False
    dispatch.register_b12x_runner(run_b12x)
    return True


def freeze(device: torch.device | str | None = None) -> None:
    """Plan nothing more on ``device`` (every device when None); see the module docstring.

    A device without an index (``"cuda"``) freezes every device of its type.
    """
    _frozen.add(None if device is None else torch.device(device))


def is_frozen(device: torch.device) -> bool:
    """Whether :func:`freeze` covers ``device``."""
    return any(
        f is None or (f.type == device.type and f.index in (None, device.index)) for f in _frozen
    )


def reset() -> None:
    """Forget every cached b12x plan, its tensors and the freeze (graphs using them must be
    gone)."""
    _plans.clear()
    _frozen.clear()


def planned_rows(key: PlanKey) -> tuple[int, ...]:
    """The token counts planned for ``key`` with any ``rows``, ascending."""
    return tuple(sorted(k.rows for k in _plans if dataclasses.replace(k, rows=key.rows) == key))


def unserved_reason(
    q_nope: torch.Tensor,
    kv_format: str,
    softmax_scale: float,
    invalid: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    rope: int = ROPE,
) -> str | None:
    """Why b12x 1.5.1 cannot run this call (None when it can)."""
    if rope != ROPE:
        return f"qk_rope_head_dim {rope} (b12x's GLM_NSA records carry a {ROPE}-wide RoPE)"
    if kv_format not in B12X_RECIPE:
        return f"kv_format {kv_format!r} has no b12x cache layout"
    if q_nope.dtype != B12X_Q_DTYPE:
        return f"q dtype {q_nope.dtype} (b12x takes bf16)"
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        return f"softmax_scale {softmax_scale} (b12x needs finite > 0)"
    if invalid is not None:
        return "an invalid-index counter (b12x masks indices < 0 but counts nothing)"
    if sink is not None:
        return "an attention sink (b12x's sparse-MLA Caps and bind take none)"
    return None


def _decline(reason: str) -> bool:
    """False (the caller runs Triton), logging ``reason`` the first time it is seen."""
    if reason not in _declined:
        _declined.add(reason)
        logger.info("vllm-mla: b12x sparse MLA declines %s; the Triton kernel serves it", reason)
    return False


def max_chunks_per_row(rows: int, num_heads: int, topk: int) -> int:
    """Split capacity: every candidate window, bounded by ``SPLIT_BUDGET_BYTES``."""
    per_chunk = rows * num_heads * LATENT * B12X_Q_DTYPE.itemsize
    windows = -(-topk // CANDIDATE_WINDOW)
    return max(1, min(MAX_CHUNKS_PER_ROW, windows, SPLIT_BUDGET_BYTES // per_chunk))


def caps_fields(module: ModuleType, key: PlanKey) -> dict[str, object]:
    """The ``Caps`` keywords of ``key``'s plan (exactly ``B12X_CAPS_FIELDS``)."""
    return {
        "device": key.device,
        "num_q_heads": key.num_heads,
        "max_q_rows": key.rows,
        "max_width": key.topk,
        "softmax_scale": key.softmax_scale,
        "dtype": B12X_Q_DTYPE,
        "kv_dtype": B12X_CACHE_DTYPE,
        "head_dim": HEAD_DIM,
        "v_head_dim": LATENT,
        "model_type": int(getattr(module.ModelType, B12X_RECIPE[key.kv_format])),
        "cache_record_bytes": record_bytes(key.kv_format),
        "mode": "decode",  # any H and K; b12x's extend path needs H % 8 == 0, K in 512/1k/2k
        "max_batch": key.rows,
        "max_chunks_per_row": max_chunks_per_row(key.rows, key.num_heads, key.topk),
        "page_size": key.page_size,
        "return_lse": key.return_lse,
        "lse_scale": "natural",
    }


def _new_plan(module: ModuleType, key: PlanKey) -> B12XPlanState:
    plan = module.plan(module.Caps(**caps_fields(module, key)))
    nbytes = int(plan.memory_requirements().scratch_nbytes)
    device = key.device
    return B12XPlanState(
        key=key,
        plan=plan,
        scratch=torch.empty(nbytes, dtype=torch.uint8, device=device),
        q=torch.zeros(key.rows, key.num_heads, HEAD_DIM, dtype=B12X_Q_DTYPE, device=device),
        indices=torch.full((key.rows, key.topk), -1, dtype=torch.int32, device=device),
        outside=torch.zeros(key.rows, key.topk, dtype=torch.bool, device=device),
        lengths=torch.zeros(key.rows, dtype=torch.int32, device=device),
    )


def plan_state(module: ModuleType, key: PlanKey, kv_cache: torch.Tensor) -> B12XPlanState:
    """The plan serving ``key.rows`` tokens: planned exactly (and primed at full capacity)
    on first use before :func:`freeze`; after it the smallest planned size >= ``key.rows``.

    Raises ``SparseMLANotPrepared`` instead of planning during CUDA-graph capture or
    after :func:`freeze`, and when no planned size is large enough after it.
    """
    state = _plans.get(key)
    if state is not None:
        return state
    planned = planned_rows(key)
    if capturing(key.device):
        raise SparseMLANotPrepared(
            f"b12x sparse-MLA call with T={key.rows} during CUDA-graph capture has no plan "
            f"of exactly that size (planned: {planned}) for {key}; "
            "prepare every captured token count before capture"
        )
    if is_frozen(key.device):
        larger = [rows for rows in planned if rows > key.rows]
        if not larger:
            raise SparseMLANotPrepared(
                f"b12x sparse-MLA call with T={key.rows} after freeze(): no planned size "
                f">= T (planned: {planned}) for {key}; declare it in SparseMLACaps"
            )
        return _plans[dataclasses.replace(key, rows=larger[0])]
    state = _new_plan(module, key)
    # Priming run: all rows, every index -1, lengths 0 (the cache is addressed, never
    # read). b12x resolves a plan's launchers from its first binding.
    _run(module, state, state.q, kv_cache, state.indices, state.lengths)
    _plans[key] = state
    return state


def fused_q(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor | None:
    """The contiguous ``[T,H,576]`` tensor whose two halves ``q_nope``/``q_pe`` are, when it
    is ``B12X_Q_ALIGN``-aligned (a view, no copy); None otherwise."""
    t, h = q_nope.shape[:2]
    strides = (h * HEAD_DIM, HEAD_DIM, 1)
    if q_nope.stride() != strides or q_pe.stride() != strides:
        return None
    if q_pe.untyped_storage().data_ptr() != q_nope.untyped_storage().data_ptr():
        return None
    if q_pe.data_ptr() != q_nope.data_ptr() + LATENT * q_nope.element_size():
        return None
    if q_nope.data_ptr() % B12X_Q_ALIGN:
        return None
    return q_nope.as_strided((t, h, HEAD_DIM), strides)


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
    invalid: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> bool:
    """Write ``out`` [T,H,512] (and natural-log ``lse`` [T,H]) for validated arguments;
    False (nothing written, the reason logged once) for a call b12x does not serve: the
    caller runs Triton.

    Same contract as ``sparse_mla_reference``. Once its plan exists (see the module
    docstring), a call allocates nothing beyond what b12x itself does.
    """
    reason = unserved_reason(q_nope, kv_format, softmax_scale, invalid, sink, q_pe.shape[-1])
    if reason is not None:
        return _decline(reason)
    t, h = q_nope.shape[:2]
    if t == 0:
        return True
    module = b12x_module()
    if module is None:
        raise RuntimeError(f"the b12x runner is registered but {B12X_MODULE} does not import")
    key = PlanKey(
        device=q_nope.device,
        kv_format=kv_format,
        num_heads=h,
        topk=indices.shape[1],
        rows=t,
        page_size=kv_cache.shape[1],
        softmax_scale=float(softmax_scale),
        return_lse=lse is not None,
    )
    state = plan_state(module, key, kv_cache)
    q = fused_q(q_nope, q_pe)
    if q is None:  # two tensors: b12x takes one contiguous q (module docstring)
        q = state.q[:t]  # contiguous: a prefix of rows
        q[..., :LATENT].copy_(q_nope)
        q[..., LATENT:].copy_(q_pe)
    outside = torch.ge(indices, cache_rows(kv_cache), out=state.outside[:t])
    indices = state.indices[:t].copy_(indices).masked_fill_(outside, -1)
    if lengths is None:
        lengths = state.lengths[:t].fill_(key.topk)  # rewritten on every call
    elif not lengths.is_contiguous():
        lengths = state.lengths[:t].copy_(lengths)
    result = _run(module, state, q, kv_cache, indices, lengths)
    output, b12x_lse = result if isinstance(result, tuple) else (result, None)
    out.copy_(output)  # output is a view into the plan's scratch (module docstring)
    if lse is not None:
        if b12x_lse is None:
            raise RuntimeError("b12x returned no lse although the plan declares return_lse")
        lse.copy_(b12x_lse)  # natural log: the plan asks for lse_scale="natural"
    return True
