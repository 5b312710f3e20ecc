"""Sparse-MLA preparation with explicit ownership: plan -> prepare -> bind -> run -> release.

Guarantees (each checked by a test in tests/test_sparse_mla_preparation.py):

- ``plan(caps)`` is declarative: it computes the scratch size and the launch variants
  to prepare, and allocates nothing.
- ``PreparationSession.prepare(plan)`` compiles/autotunes every declared variant on
  synthetic probe tensors that are freed when it returns: no plan, binding, session
  or closure keeps them. It verifies this itself (weak references) and raises
  ``ProbeRetained`` when a probe outlives it.
- After ``freeze()``, a launch whose variant was not prepared raises
  ``SparseMLANotPrepared`` instead of compiling (also during CUDA-graph capture,
  frozen or not); ``prepare`` raises ``PreparationFrozen``. Where the kernel module
  tracks its compiled variants (``compiled_variants()``), a run after ``freeze()``
  that made it compile anything raises too (the kernel's own key sees strides and
  alignment, which a plan cannot).
- ``bind(plan, scratch=, q=, kv_cache=, indices=, lengths=)`` holds only the
  caller-owned live inputs; ``run(binding)`` launches on them.
- ``release(plan)`` drops the prepared variants of the plan; bindings and bound calls
  of a released plan raise ``PlanReleased``. Scratch is always caller-owned.
- ``bound_call(plan, ...)`` is the decode-step entry: everything fixed for a launch site
  is checked once (the first call, and again when the KV pool changes), then every
  step costs a few comparisons and one launch: no allocation, no sort, no set.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from vllm_mla.ops.capture import capturing
from vllm_mla.ops.dcp import NO_DCP, DCPShard
from vllm_mla.ops.sparse_mla import api, dispatch
from vllm_mla.ops.sparse_mla.formats import (
    KV_FORMATS,
    LATENT,
    ROPE,
    ROPES,
    SparseMLANotPrepared,
    record_width,
)
from vllm_mla.ops.sparse_mla.validate import Q_DTYPES

# Implementations with nothing to compile: prepare records their variants without
# probes (full-capacity probes through plain torch would be huge and useless).
NO_COMPILE_IMPLS = ("reference",)


class PreparationError(RuntimeError):
    """Base of the preparation errors (ownership and lifetime, not argument checks)."""


class PreparationFrozen(PreparationError):
    """``prepare`` was called after ``freeze()``."""


class ProbeRetained(PreparationError):
    """A synthetic probe tensor is still referenced after ``prepare`` returned."""


class PlanReleased(PreparationError):
    """A binding or scratch request refers to a plan that ``release`` has dropped."""


@dataclass(frozen=True)
class SparseMLACaps:
    """Declared capacities of one sparse-MLA launch site (a layer group).

    ``token_buckets`` are the token counts prepared (graph-visible sizes); empty means
    powers of two up to ``max_tokens`` plus ``max_tokens`` itself. ``dcp``: the bound
    call takes request positions of a decode-context-parallel group (``ops.dcp``; the
    Triton kernel's DCP variant is the one prepared). ``sink``: every call passes an
    attention sink (fp32 ``[num_heads]``; the kernel's ``SINK`` variant is the one
    prepared), and no call omits it. ``rope``: qk_rope_head_dim, 64 or 0 (latent-512 MLA
    without RoPE: q_pe is ``[T, H, 0]`` and the records are rope 0's, ``formats``).
    """

    max_tokens: int
    num_heads: int
    topk: int
    kv_format: str = "fp8_ds_mla"
    block_size: int = 64
    q_dtype: torch.dtype = torch.bfloat16
    split_query: bool = True  # q arrives as (q_nope [T,H,512] strided, q_pe [T,H,64])
    with_lengths: bool = False
    return_lse: bool = False
    token_buckets: tuple[int, ...] = ()
    dcp: bool = False
    sink: bool = False
    rope: int = ROPE

    def __post_init__(self) -> None:
        if self.rope not in ROPES:
            raise ValueError(f"SparseMLACaps.rope: expected one of {ROPES}, got {self.rope!r}")
        for name in ("max_tokens", "num_heads", "topk", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SparseMLACaps.{name}: expected a positive int, got {value!r}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(
                f"SparseMLACaps.kv_format: expected one of {KV_FORMATS}, got {self.kv_format!r}"
            )
        if self.block_size % 64:
            raise ValueError(
                f"SparseMLACaps.block_size: expected a multiple of 64, got {self.block_size}"
            )
        if self.q_dtype not in Q_DTYPES:
            raise TypeError(
                f"SparseMLACaps.q_dtype: expected one of {Q_DTYPES} (the op's), got {self.q_dtype}"
            )
        bad = [t for t in self.token_buckets if not 1 <= t <= self.max_tokens]
        if bad:
            raise ValueError(
                f"SparseMLACaps.token_buckets: expected sizes in [1, {self.max_tokens}], got {bad}"
            )

    def buckets(self) -> tuple[int, ...]:
        """The prepared token counts, ascending; the last is ``max_tokens``."""
        if self.token_buckets:
            return tuple(sorted(set(self.token_buckets) | {self.max_tokens}))
        powers = itertools.takewhile(lambda t: t < self.max_tokens, (1 << i for i in range(40)))
        return (*powers, self.max_tokens)

    def bucket(self, num_tokens: int) -> int:
        """The smallest prepared token count >= ``num_tokens``."""
        for size in self.buckets():
            if num_tokens <= size:
                return size
        raise ValueError(
            f"{num_tokens} tokens exceed the declared capacity max_tokens={self.max_tokens}"
        )


def load_kernel() -> ModuleType:
    """The sparse-MLA kernel interface (``ops.sparse_mla.api``: select_impl, scratch_bytes,
    sparse_mla_forward, compiled_variants); tests pass fakes of it."""
    return api


@dataclass(frozen=True)
class SparseMLAPlan:
    """What a launch site needs; holds sizes and keys only, never a tensor."""

    caps: SparseMLACaps
    impl: str
    scratch_bytes: int
    variants: tuple[tuple, ...]
    plan_id: int = field(default_factory=itertools.count().__next__, compare=False)


def launch_key(caps: SparseMLACaps, impl: str, num_tokens: int, device: torch.device) -> tuple:
    """The launch specialization a prepared variant stands for."""
    return (
        impl,
        device.type,
        caps.kv_format,
        caps.num_heads,
        caps.topk,
        caps.bucket(num_tokens),
        caps.q_dtype,
        caps.split_query,
        caps.with_lengths,
        caps.return_lse,
        caps.dcp,
        caps.sink,
        caps.rope,
    )


def plan(
    caps: SparseMLACaps,
    *,
    device: torch.device | str = "cpu",
    kernel: Any = None,
    impl: str | None = None,
) -> SparseMLAPlan:
    """Declare a launch site: its scratch size and variants. Allocates nothing.

    ``impl`` forces an implementation (tests, benchmarks); default: the kernel's choice
    for ``device``.
    """
    kernel = kernel if kernel is not None else load_kernel()
    device = torch.device(device)
    impl = impl or kernel.select_impl(device)
    scratch = int(
        kernel.scratch_bytes(caps.max_tokens, caps.num_heads, caps.topk, kv_format=caps.kv_format)
    )
    variants = tuple(launch_key(caps, impl, t, device) for t in caps.buckets())
    return SparseMLAPlan(caps, impl, scratch, variants)


@dataclass(frozen=True)
class SparseMLABinding:
    """Caller-owned live inputs bound to a plan; nothing here is owned by the session."""

    plan: SparseMLAPlan
    scratch: torch.Tensor | None
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    kv_cache: torch.Tensor
    indices: torch.Tensor
    lengths: torch.Tensor | None = None
    out: torch.Tensor | None = None
    sink: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return (self.q[0] if isinstance(self.q, tuple) else self.q).shape[0]


class PreparationSession:
    """Owns prepared variants and (optionally) per-plan scratch; see the module docstring.

    ``probe_observer`` (tests, census) is called with every probe tensor created; it
    must not keep a strong reference or ``prepare`` raises ``ProbeRetained``.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        kernel: Any = None,
        probe_observer: Callable[[str, torch.Tensor], None] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._kernel = kernel
        self._observer = probe_observer
        self._prepared: dict[int, set[tuple]] = {}
        self._released: set[int] = set()
        self._frozen = False
        self._frozen_variants: int | None = None

    @property
    def kernel(self) -> Any:
        if self._kernel is None:
            self._kernel = load_kernel()
        return self._kernel

    @property
    def frozen(self) -> bool:
        return self._frozen

    def plan(self, caps: SparseMLACaps, impl: str | None = None) -> SparseMLAPlan:
        """``plan(caps)`` for this session's device and kernel."""
        return plan(caps, device=self.device, kernel=self.kernel, impl=impl)

    def prepare(self, plan: SparseMLAPlan) -> None:
        """Launch every declared variant once on synthetic probes, then verify they died."""
        if self._frozen:
            raise PreparationFrozen(
                f"prepare(plan {plan.plan_id}) after freeze(): preparation must finish "
                "before CUDA-graph capture"
            )
        self._released.discard(plan.plan_id)
        probes: list[tuple[str, weakref.ref]] = []
        for num_tokens in plan.caps.buckets():
            if plan.impl not in NO_COMPILE_IMPLS:
                self._probe_launch(plan, num_tokens, probes)
            self._prepared.setdefault(plan.plan_id, set()).add(
                launch_key(plan.caps, plan.impl, num_tokens, self.device)
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        alive = [name for name, ref in probes if ref() is not None]
        if alive:
            gc.collect()  # a reference cycle is not a retention; only a live owner is
            alive = [name for name, ref in probes if ref() is not None]
        if alive:
            raise ProbeRetained(
                f"probe tensors still referenced after prepare(plan {plan.plan_id}): "
                f"{', '.join(alive)} (expected none; a plan, cache or closure keeps them)"
            )

    def _probe_launch(
        self, plan: SparseMLAPlan, num_tokens: int, probes: list[tuple[str, weakref.ref]]
    ) -> None:
        """One launch on fresh probes; they are locals of this frame only."""
        caps = plan.caps
        gen = torch.Generator(device="cpu").manual_seed(num_tokens)
        width, cache_dtype = record_width(caps.kv_format, caps.rope)
        blocks = -(-caps.topk // caps.block_size)
        rows = blocks * caps.block_size
        if caps.split_query:
            full = torch.randn(num_tokens, caps.num_heads, LATENT + caps.rope, generator=gen)
            full = full.to(device=self.device, dtype=caps.q_dtype)
            q: Any = (full[..., :LATENT], full[..., LATENT:])  # strided like vLLM's
        else:
            full = torch.randn(num_tokens, caps.num_heads, LATENT + caps.rope, generator=gen)
            q = full = full.to(device=self.device, dtype=caps.q_dtype)
        if cache_dtype == torch.uint8:
            kv = torch.zeros(blocks, caps.block_size, width, dtype=cache_dtype, device=self.device)
        else:
            kv = torch.randn(blocks, caps.block_size, width, generator=gen)
            kv = kv.to(device=self.device, dtype=cache_dtype)
        idx = torch.randint(-1, rows, (num_tokens, caps.topk), generator=gen, dtype=torch.int32)
        idx = idx.to(self.device)
        lengths = None
        if caps.with_lengths:
            lengths = torch.full((num_tokens,), caps.topk, dtype=torch.int32, device=self.device)
        sink = None
        if caps.sink:
            sink = torch.zeros(caps.num_heads, dtype=torch.float32, device=self.device)
        scratch = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=self.device)
        named = {"q": full, "kv_cache": kv, "indices": idx, "scratch": scratch}
        if lengths is not None:
            named["lengths"] = lengths
        if sink is not None:
            named["sink"] = sink
        for name, tensor in named.items():
            probes.append((f"{name}[T={num_tokens}]", weakref.ref(tensor)))
            if self._observer is not None:
                self._observer(name, tensor)
        self.kernel.sparse_mla_forward(
            q,
            kv,
            idx,
            (LATENT + caps.rope) ** -0.5,
            kv_format=caps.kv_format,
            lengths=lengths,
            scratch=scratch,
            return_lse=caps.return_lse,
            impl=plan.impl,
            sink=sink,
        )
        if plan.impl == "triton":  # the bound decode call's variant: logical rows mapped
            self._probe_logical(plan, q, kv, idx.clamp(min=-1), scratch, probes, sink)

    def _probe_logical(self, plan, q, kv, logical, scratch, probes, sink=None) -> None:
        """Launch the variant ``BoundCall`` runs (logical top-k mapped in the kernel, no
        lengths; the lse when the plan returns it, the sink when it declares one) on the
        probes; its own probes are locals of this frame only."""
        from vllm_mla.ops.sparse_mla import triton_kernels

        caps, t = plan.caps, logical.shape[0]
        q_nope, q_pe = q if isinstance(q, tuple) else (q[..., :LATENT], q[..., LATENT:])
        req_id = torch.zeros(t, dtype=torch.int32, device=self.device)
        block_table = torch.arange(kv.shape[0], dtype=torch.int32, device=self.device)[None]
        out = torch.empty(t, caps.num_heads, LATENT, dtype=caps.q_dtype, device=self.device)
        lse = None
        named = [("req_id", req_id), ("block_table", block_table), ("out", out)]
        if caps.return_lse:
            lse = torch.empty(t, caps.num_heads, dtype=torch.float32, device=self.device)
            named.append(("lse", lse))
        for name, tensor in named:
            probes.append((f"{name}[T={t}]", weakref.ref(tensor)))
        site = triton_kernels.LaunchSite(
            kv,
            caps.num_heads,
            caps.topk,
            caps.kv_format,
            (LATENT + caps.rope) ** -0.5,
            caps.q_dtype,
            rope=caps.rope,
        )
        site.launch(
            q_nope,
            q_pe,
            kv,
            logical,
            out,
            scratch,
            lse=lse,
            req_id=req_id,
            block_table=block_table,
            dcp=(2, 0, 1) if caps.dcp else NO_DCP.args,  # any group: the variant is one
            sink=sink,
        )

    def freeze(self) -> None:
        """From now on an unprepared variant raises instead of compiling, and the b12x
        runner plans nothing more on this session's device (``b12x_runner.freeze``)."""
        from vllm_mla.ops.sparse_mla import b12x_runner  # imports no b12x code

        self._frozen = True
        self._frozen_variants = self._compiled_count()
        b12x_runner.freeze(self.device)

    def _compiled_count(self) -> int | None:
        tracked = getattr(self.kernel, "compiled_variants", None)
        return len(tracked()) if callable(tracked) else None

    def is_prepared(self, plan: SparseMLAPlan, num_tokens: int) -> bool:
        key = launch_key(plan.caps, plan.impl, num_tokens, self.device)
        return key in self._prepared.get(plan.plan_id, ())

    def bind(
        self,
        plan: SparseMLAPlan,
        *,
        scratch: torch.Tensor | None,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        lengths: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        sink: torch.Tensor | None = None,
    ) -> SparseMLABinding:
        """Bind live inputs (validated against the plan's capacities)."""
        self._check_live(plan)
        caps = plan.caps
        binding = SparseMLABinding(plan, scratch, q, kv_cache, indices, lengths, out, sink)
        tokens = binding.num_tokens
        if tokens > caps.max_tokens:
            raise ValueError(f"q: expected at most {caps.max_tokens} tokens, got {tokens}")
        if isinstance(q, tuple) != caps.split_query:
            raise TypeError(
                f"q: expected {'a (q_nope, q_pe) tuple' if caps.split_query else 'a tensor'}, "
                f"got {type(q).__name__}"
            )
        q_full = q[0] if isinstance(q, tuple) else q
        if q_full.shape[1] != caps.num_heads or q_full.dtype != caps.q_dtype:
            raise ValueError(
                f"q: expected {caps.q_dtype} with {caps.num_heads} heads, "
                f"got {q_full.dtype} with {q_full.shape[1]}"
            )
        if indices.dtype != torch.int32 or tuple(indices.shape) != (tokens, caps.topk):
            raise ValueError(
                f"indices: expected int32 [{tokens}, {caps.topk}], "
                f"got {indices.dtype} {list(indices.shape)}"
            )
        width, dtype = record_width(caps.kv_format, caps.rope)
        if kv_cache.dtype != dtype or kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
            raise ValueError(
                f"kv_cache: expected {dtype} [blocks, rows, {width}] for {caps.kv_format}, "
                f"got {kv_cache.dtype} {list(kv_cache.shape)}"
            )
        if (lengths is not None) != caps.with_lengths:
            raise ValueError(
                f"lengths: the plan declares with_lengths={caps.with_lengths}, "
                f"got {'a tensor' if lengths is not None else 'None'}"
            )
        _check_sink(sink, caps)
        if scratch is not None and scratch.numel() * scratch.element_size() < plan.scratch_bytes:
            raise ValueError(
                f"scratch: expected at least {plan.scratch_bytes} bytes, "
                f"got {scratch.numel() * scratch.element_size()}"
            )
        return binding

    def run(
        self, binding: SparseMLABinding, *, softmax_scale: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Launch on the bound inputs; (out [T,H,512], lse [T,H] or None)."""
        plan = binding.plan
        self._check_live(plan)
        device = binding.kv_cache.device
        key = launch_key(plan.caps, plan.impl, binding.num_tokens, device)
        if key not in self._prepared.get(plan.plan_id, ()) and (self._frozen or capturing(device)):
            raise SparseMLANotPrepared(
                f"sparse-MLA variant {key} of plan {plan.plan_id} was not prepared "
                f"(prepared: {sorted(self._prepared.get(plan.plan_id, ()), key=str)}); "
                "declare its token count in SparseMLACaps and prepare before capture"
            )
        scale = (LATENT + plan.caps.rope) ** -0.5 if softmax_scale is None else softmax_scale
        result = self.kernel.sparse_mla_forward(
            binding.q,
            binding.kv_cache,
            binding.indices,
            scale,
            kv_format=plan.caps.kv_format,
            lengths=binding.lengths,
            out=binding.out,
            scratch=binding.scratch,
            return_lse=plan.caps.return_lse,
            impl=plan.impl,
            sink=binding.sink,
        )
        if self._frozen and self._frozen_variants is not None:
            compiled = self._compiled_count()
            if compiled != self._frozen_variants:
                raise SparseMLANotPrepared(
                    f"the kernel compiled {compiled - self._frozen_variants} new variant(s) "
                    f"after freeze() for plan {plan.plan_id} at T={binding.num_tokens}: "
                    "a live input's strides or alignment differ from the probes'"
                )
        return result

    def release(self, plan: SparseMLAPlan) -> None:
        """Forget the plan's variants (graphs must be gone); its bindings stop working."""
        self._prepared.pop(plan.plan_id, None)
        self._released.add(plan.plan_id)

    def bound_call(
        self,
        plan: SparseMLAPlan,
        *,
        softmax_scale: float,
        buffers: Callable[[int], tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
        dcp: DCPShard = NO_DCP,
    ) -> BoundCall:
        """The decode-step call of ``plan`` (see ``BoundCall``); ``buffers(t)`` gives the
        (scratch, out) for ``t`` tokens (None, None: the call allocates out); ``dcp``:
        this rank's DCP shard (logical calls then take request positions of the group),
        for a plan that declares ``caps.dcp``."""
        self._check_live(plan)
        if dcp.trivial == plan.caps.dcp:
            raise ValueError(
                f"sparse MLA bound call: a DCP shard of size {dcp.size} for a plan with "
                f"caps.dcp={plan.caps.dcp} (declare dcp=True exactly when the group has "
                "more than one rank, so its variant is prepared)"
            )
        return BoundCall(self, plan, float(softmax_scale), buffers, dcp)

    def _check_live(self, plan: SparseMLAPlan) -> None:
        if plan.plan_id in self._released:
            raise PlanReleased(f"plan {plan.plan_id} was released; prepare it again to reuse")


def _check_sink(
    sink: torch.Tensor | None, caps: SparseMLACaps, device: torch.device | None = None
) -> None:
    """A sink exactly when ``caps.sink``: fp32 ``[num_heads]``, unit stride, on ``device``."""
    if (sink is not None) != caps.sink:
        raise ValueError(
            f"sink: the plan declares sink={caps.sink}, got "
            f"{'a tensor' if sink is not None else 'None'}"
        )
    if sink is None:
        return
    if sink.dtype is not torch.float32 or sink.shape != (caps.num_heads,) or sink.stride(0) != 1:
        raise ValueError(
            f"sink: expected fp32 [{caps.num_heads}] with unit stride, got {sink.dtype} "
            f"{tuple(sink.shape)} strides {sink.stride()}"
        )
    if device is not None and sink.device != device:
        raise ValueError(f"sink: expected device {device} (q's), got {sink.device}")


class BoundCall:
    """One launch site's decode-step call: validated once, then a few comparisons per step.

    Fixed for the site (checked by the full contract on the first call, and again when a
    different KV pool arrives): heads, top-k, q dtype, cache format and geometry, the
    plan's implementation. Per step only the token count (against the plan's capacity),
    the pool's identity (a weak reference: the call never keeps a pool alive) and the
    heads/top-k/dtype of the live tensors are compared. Then it launches directly: the
    Triton kernels, the b12x runner (Triton for a call it does not serve) or the
    reference; forward_mqa -> ``run`` -> launch. Frozen sessions keep their guarantee:
    a variant the kernel compiles after ``freeze()`` raises.

    Decode context parallelism (``dcp``, ``ops.dcp.DCPShard``): a logical call's top-k
    holds request positions of the whole DCP group; the kernel attends to those this
    rank holds (``maps_logical``); physical rows are the caller's to filter
    (``selection.logical_to_physical(..., shard=)``). ``run(..., lse=)`` writes the
    natural-log LSE vLLM merges the ranks by (a row with none of this rank's tokens:
    out 0, lse -inf, the merge's identity: Triton and the reference; the backend does
    not plan b12x under DCP).
    """

    __slots__ = (
        *("_buffers", "_cache", "_caps", "_dcp", "_plan", "_scale", "_session", "_site"),
        "maps_logical",
    )

    def __init__(
        self,
        session: PreparationSession,
        plan: SparseMLAPlan,
        softmax_scale: float,
        buffers: Callable[[int], tuple[torch.Tensor | None, torch.Tensor | None]] | None,
        dcp: DCPShard = NO_DCP,
    ) -> None:
        self._session = session
        self._dcp = dcp.args
        self._plan = plan
        self._caps = plan.caps
        self._scale = softmax_scale
        self._buffers = buffers
        self._cache: weakref.ref | None = None
        self._site = None  # triton_kernels.LaunchSite of the validated pool's geometry
        # Whether ``run`` takes logical top-k positions with ``req_id``/``block_table``
        # (the Triton kernel maps them itself, so no conversion kernel runs first).
        self.maps_logical = plan.impl == "triton"

    def _validate(self, q_nope, q_pe, kv_cache, indices) -> None:
        from vllm_mla.ops.sparse_mla.validate import validate

        caps = self._caps
        validate((q_nope, q_pe), kv_cache, indices, kv_format=caps.kv_format)
        if q_pe.shape[-1] != caps.rope:
            raise ValueError(
                f"q_pe: the plan declares rope={caps.rope}, got shape {tuple(q_pe.shape)}"
            )
        self._session._check_live(self._plan)
        if not self._session.is_prepared(self._plan, caps.max_tokens) and (
            self._session.frozen or capturing(kv_cache.device)
        ):
            raise SparseMLANotPrepared(
                f"plan {self._plan.plan_id} was not prepared; prepare it before capture"
            )
        if self._plan.impl in ("triton", "b12x"):
            from vllm_mla.ops.sparse_mla import triton_kernels

            site = self._site
            if site is None or not site.matches(kv_cache):
                self._site = triton_kernels.LaunchSite(
                    kv_cache,
                    caps.num_heads,
                    caps.topk,
                    caps.kv_format,
                    self._scale,
                    caps.q_dtype,
                    rope=caps.rope,
                )
        self._cache = weakref.ref(kv_cache)

    def _check_optional(self, t, device, sink, lse, req_id, block_table) -> None:
        """The optional arguments of a ``t``-token call against the plan (an error names
        what is wrong): the sink, the lse buffer, the logical top-k's tables."""
        caps = self._caps
        if (sink is not None) != caps.sink or (
            sink is not None
            and (
                sink.dtype is not torch.float32
                or sink.shape != (caps.num_heads,)
                or sink.stride(0) != 1
                or sink.device != device
            )
        ):
            _check_sink(sink, caps, device)  # names what is wrong
        if lse is not None and (
            not caps.return_lse
            or lse.dtype is not torch.float32
            or lse.shape != (t, caps.num_heads)
            or lse.stride(1) != 1
        ):
            raise ValueError(
                f"sparse MLA lse: expected a plan with return_lse (got {caps.return_lse}) "
                f"and fp32 [{t}, {caps.num_heads}] with unit head stride; got {lse.dtype} "
                f"{tuple(lse.shape)} strides {lse.stride()}"
            )
        if block_table is not None and (
            not self.maps_logical
            or block_table.dtype is not torch.int32
            or block_table.dim() != 2
            or req_id is None
            or req_id.dtype is not torch.int32
            or req_id.shape[0] < t
        ):
            raise ValueError(
                f"sparse MLA logical call (plan impl {self._plan.impl!r}): expected the "
                "triton plan, int32 block_table [requests, blocks] and int32 req_id of at "
                f"least {t} entries; got block_table {block_table.dtype} "
                f"{tuple(block_table.shape)}, req_id "
                f"{None if req_id is None else (req_id.dtype, tuple(req_id.shape))}"
            )

    def run(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        indices: torch.Tensor,
        req_id: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out [T, H, 512]`` for ``indices [T, K]``: physical rows (the forward
        contract), or, with ``req_id`` (int32, >= T entries) and ``block_table`` (int32
        ``[requests, blocks]`` of the cache's block size) when :attr:`maps_logical`,
        logical top-k positions mapped as ``selection.logical_to_physical`` maps them
        (with the call's DCP shard). ``lse``: fp32 ``[T, H]`` written with the natural-log
        LSE (the plan must declare ``return_lse``, so its variant is prepared). ``sink``:
        fp32 ``[H]`` attention-sink logits, passed exactly when the plan declares
        ``caps.sink`` (checked every call: a few attribute reads)."""
        caps = self._caps
        t = indices.shape[0]
        if sink is not None or caps.sink or lse is not None or block_table is not None:
            self._check_optional(t, q_nope.device, sink, lse, req_id, block_table)
        if self._cache is None or self._cache() is not kv_cache:
            self._validate(q_nope, q_pe, kv_cache, indices)
        if (
            t > caps.max_tokens
            or q_nope.shape[1] != caps.num_heads
            or indices.shape[1] != caps.topk
            or q_nope.dtype is not caps.q_dtype
            or q_nope.shape[0] != t
            or q_pe.shape[-1] != caps.rope
        ):
            self._validate(q_nope, q_pe, kv_cache, indices)  # names what is wrong
            raise ValueError(
                f"sparse MLA call: expected at most {caps.max_tokens} tokens of "
                f"{caps.num_heads} heads, {caps.q_dtype}, top-k {caps.topk}; got "
                f"{tuple(q_nope.shape)} {q_nope.dtype}, indices {tuple(indices.shape)}"
            )
        scratch, out = self._buffers(t) if self._buffers is not None else (None, None)
        if out is None:
            out = q_nope.new_empty((t, caps.num_heads, LATENT))
        compiled = dispatch.run(
            self._plan.impl,
            q_nope,
            q_pe,
            kv_cache,
            indices,
            out,
            softmax_scale=self._scale,
            kv_format=caps.kv_format,
            lse=lse,
            scratch=scratch,
            site=self._site,
            req_id=req_id,
            block_table=block_table,
            dcp=self._dcp,
            sink=sink,
        )
        if compiled and self._session._frozen:
            raise SparseMLANotPrepared(
                f"the kernel compiled a new variant after freeze() for plan "
                f"{self._plan.plan_id} at T={t}: a live input's strides or alignment differ "
                "from the probes'"
            )
        return out
