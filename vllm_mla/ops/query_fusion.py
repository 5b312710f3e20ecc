"""Deferred query absorption: W_UK_T's bmm waits for the call that builds the final query.

vLLM's MLA decode (``MLAAttention.forward_impl``) builds the query in separate calls:
``torch.bmm(q_nope, W_UK_T, out=ql_nope)`` into a ``[M, H, L]`` buffer it allocates, then a
concat with q_pe, in the backend's ``forward_mqa`` or, before an FP8 cache, together with
the quantization in ``_decode_concat_quant_fp8_op``. With a ``QueryFusion`` attached to a
routed W_UK_T (``AbsorbedWeight.attach_fusion``) and its layer *armed* (``arm``), the bmm
is recorded instead of launched (``QueryFusion.defer``), and the call that would
concatenate takes it (``project_bf16`` / ``project_fp8``) and writes the final query
``[q_nope @ W_UK_T | q_pe]`` (``[M, H, L + R]``, BF16 or FP8) with one
``mla_query_projection`` launch where ``can_fuse_query_projection`` admitted the layer
(``kernel=True``): one kernel where vLLM runs two (bmm, cat) or three (bmm, cat, quant).
Elsewhere (CPU engines, fp32, shapes outside the kernel's gate) the torch path runs the
weight's own bmm straight into the query's left part and copies q_pe beside it
(``torch_projection``): the staged values bit for bit, without the concat's temporaries.

No value is ever missing:

- a bmm defers only while its own layer is armed; the vLLM integration arms a layer for
  exactly its ``forward_impl``, where the deferred output's next reader is one of the two
  consumers (it never defers where another reader could come first: DCP, padded heads);
- a consumer that declines (another buffer, q_pe of another shape, a ``scale_ub``, a
  variant not prewarmed during CUDA-graph capture) runs the pending bmm first (``flush``),
  then goes on as upstream does;
- a second deferral, any other eager bmm on a routed weight, arming another layer and
  disarming all run a pending bmm nobody took.

Pending state is per thread. Counts (``calls()``): ``<consumer>:<path>`` per projection
(consumer ``forward_mqa`` or ``concat_quant_fp8``, path ``triton`` or ``torch``),
``flushed:<why>`` per bmm run late, ``rows:<path>`` per DSA row query.

Hot path: deferral is ``torch.bmm`` -> ``AbsorbedWeight.__torch_function__`` -> ``defer``
(no launch, no allocation). The consumer is vLLM's call -> ``project_bf16``/``project_fp8``
-> ``query_projection.kernel.launch`` -> the kernel: three hops; the argument record of each M
is built once per layer; the one allocation is the query itself, which replaces the concat's
(and the quant's) output.

Contract of the result (``query_projection``'s): the staged path (bmm -> cat -> quant)
within one BF16 ulp before quantization (the torch path computes the staged values with the
staged bmm itself: equal); FP8 as ``e4m3(clamp(bf16 / q_scale, -448, 448))``.

DSA row layout (``row_query``): a W_UK_T bound with ``row_width`` W = L + R returns, from a
bmm without ``out``, ``[H, M, L]`` as a view of a ``[M, H, W]`` buffer
(``absorbed_matmul.dispatch.new_out``), so vLLM's ``ql_nope`` (its transpose) is the left part of
one contiguous query buffer; ``row_query`` copies q_pe into the right part and returns the
whole ``[M, H, W]`` query: the b12x plan then reads it in place (one copy of q_pe where it
copied both halves), the Triton plan reads its two halves as views.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import NamedTuple

import torch

from vllm_mla.formats import E4M3_MAX
from vllm_mla.ops.absorbed_matmul import dispatch as bmm_dispatch
from vllm_mla.ops.base import KernelNotPrewarmed, MXFP8Weight
from vllm_mla.ops.query_projection.api import Args

_calls: Counter[str] = Counter()


class _Slot(threading.local):
    armed: QueryFusion | None = None
    pending: Pending | None = None


SLOT = _Slot()  # this thread's armed layer and pending bmm


class Pending(NamedTuple):
    """A deferred ``out = a @ W_UK_T``: ``a [H, M, P]``, ``out [H, M, L]`` (token-major buffer)."""

    fusion: QueryFusion
    a: torch.Tensor
    out: torch.Tensor


class QueryFusion:
    """One layer's deferred query absorption, attached to its routed W_UK_T.

    ``weight`` is the layer's ``AbsorbedWeight`` W_UK_T ``[H, P, L]`` (dense or MXFP8 views);
    ``rope`` the q_pe width R; ``max_m`` the largest token count that defers; ``kernel``
    whether the Triton kernel runs (else the torch path).
    """

    __slots__ = (
        "_args",
        "_launch",
        "dtype",
        "heads",
        "kernel",
        "latent",
        "max_m",
        "nope",
        "rope",
        "weight",
    )

    def __init__(self, weight, *, rope: int, max_m: int, kernel: bool) -> None:
        self.weight = weight
        self.heads, self.nope, self.latent = (int(d) for d in weight.shape)
        self.rope = int(rope)
        self.dtype = weight.dtype
        self.max_m = int(max_m)
        self.kernel = bool(kernel)
        self._args: dict[tuple[int, bool], Args] = {}
        self._launch = None
        if self.kernel:
            from vllm_mla.ops.query_projection import kernel  # Triton is optional

            self._launch = kernel.launch

    def __repr__(self) -> str:
        return (
            f"QueryFusion(H={self.heads}, P={self.nope}, L={self.latent}, R={self.rope}, "
            f"max_m={self.max_m}, {'triton' if self.kernel else 'torch'})"
        )

    @property
    def path(self) -> str:
        return "triton" if self.kernel else "torch"

    def defer(self, a: torch.Tensor, out: torch.Tensor) -> bool:
        """Record ``out = a @ W`` instead of running it, when this layer is armed and ``out``
        is vLLM's token-major decode buffer; False (nothing recorded): run it now."""
        slot = SLOT
        if slot.armed is not self:
            return False
        h, m, k = a.shape
        latent = self.latent
        if (
            m > self.max_m
            or m == 0
            or h != self.heads
            or k != self.nope
            or a.dtype is not self.dtype
            or a.stride(2) != 1
            or out.dtype is not self.dtype
            or tuple(out.shape) != (h, m, latent)
            or out.stride() != (latent, h * latent, 1)
        ):
            return False
        if slot.pending is not None:
            _flush(slot.pending, "unclaimed")
        slot.pending = Pending(self, a, out)
        return True

    def args(self, m: int, fp8_out: bool) -> Args:
        """The projection's argument record for ``m`` tokens (built once per M)."""
        key = (m, fp8_out)
        found = self._args.get(key)
        if found is None:
            w = self.weight
            weight = w.weight
            if isinstance(weight, MXFP8Weight) and weight.scales.dtype != torch.uint8:
                weight = MXFP8Weight(weight.values, weight.scales.view(torch.uint8))
            found = Args(m, self.heads, self.nope, self.latent, self.rope, weight, fp8_out)
            self._args[key] = found
        return found


def arm(fusion: QueryFusion) -> None:
    """Make ``fusion``'s layer the one whose W_UK_T bmm defers (this thread)."""
    slot = SLOT
    if slot.pending is not None:
        _flush(slot.pending, "unclaimed")
    slot.armed = fusion


def disarm() -> None:
    """No layer defers any more; a bmm nobody took runs now."""
    slot = SLOT
    slot.armed = None
    if slot.pending is not None:
        _flush(slot.pending, "unclaimed")


def pending() -> bool:
    """Whether a deferred bmm waits on this thread."""
    return SLOT.pending is not None


def flush_pending(why: str) -> None:
    """Run this thread's deferred bmm, if any, now."""
    if SLOT.pending is not None:
        _flush(SLOT.pending, why)


def _flush(p: Pending, why: str) -> None:
    SLOT.pending = None
    w = p.fusion.weight
    bmm_dispatch.run(p.a, w._values, w._scales, p.out, w.role, w.path)
    _calls[f"flushed:{why}"] += 1


def _claim(ql_nope: torch.Tensor, q_pe: torch.Tensor, scale_ub) -> Pending | None:
    """The pending bmm whose output ``ql_nope`` is, if the projection can take it; a pending
    bmm it cannot take runs now (None)."""
    slot = SLOT
    p = slot.pending
    if p is None:
        return None
    slot.pending = None
    out = p.out
    h, m, latent = out.shape
    if (
        scale_ub is None
        and ql_nope.data_ptr() == out.data_ptr()
        and ql_nope.shape == (m, h, latent)
        and ql_nope.stride() == (h * latent, latent, 1)
        and q_pe.shape == (m, h, p.fusion.rope)
        and q_pe.dtype is out.dtype
        and q_pe.stride(2) == 1
        and q_pe.device == out.device
    ):
        return p
    _flush(p, "declined")
    return None


def project_bf16(ql_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor | None:
    """The ``(ql_nope, q_pe)`` pair vLLM hands ``forward_mqa`` as one ``[M, H, L + R]``
    query in the activation dtype, when ``ql_nope`` is the pending bmm's output (written by
    one projection); None: nothing pending here (a pending bmm it cannot take ran first)."""
    p = _claim(ql_nope, q_pe, None)
    if p is None:
        return None
    return _project(p, q_pe, None, "forward_mqa")


def project_fp8(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    q_scale: torch.Tensor,
    scale_ub: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``e4m3(clamp([ql_nope | q_pe] / q_scale))`` ``[M, H, L + R]`` (what vLLM's
    ``_decode_concat_quant_fp8_op`` returns) by one projection, when ``ql_nope`` is the
    pending bmm's output; None otherwise (a pending bmm it cannot take ran first)."""
    p = _claim(ql_nope, q_pe, scale_ub)
    if p is None:
        return None
    if not (
        isinstance(q_scale, torch.Tensor)
        and q_scale.dtype is torch.float32
        and q_scale.numel() == 1
        and q_scale.device == ql_nope.device
    ):
        _flush(p, "declined")
        return None
    return _project(p, q_pe, q_scale, "concat_quant_fp8")


def _project(
    p: Pending, q_pe: torch.Tensor, q_scale: torch.Tensor | None, consumer: str
) -> torch.Tensor | None:
    """The claimed ``p`` as one new query (FP8 with ``q_scale``, else the activation
    dtype); None when the kernel's variant was not prewarmed (``p`` then ran staged)."""
    f = p.fusion
    m = p.out.shape[1]
    dtype = f.dtype if q_scale is None else torch.float8_e4m3fn
    out = torch.empty((m, f.heads, f.latent + f.rope), dtype=dtype, device=q_pe.device)
    if f.kernel:
        try:
            f._launch(f.args(m, q_scale is not None), p.a.transpose(0, 1), q_pe, out, q_scale)
        except KernelNotPrewarmed:
            _flush(p, "not prewarmed")
            return None
        _calls[f"{consumer}:triton"] += 1
    else:
        torch_projection(f, p.a, q_pe, out, q_scale)
        _calls[f"{consumer}:torch"] += 1
    return out


def torch_projection(
    f: QueryFusion,
    a: torch.Tensor,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
) -> None:
    """``out = [a^T @ W | q_pe]`` (FP8 with ``q_scale``) without the kernel: the weight's own
    bmm (its path, as the staged bmm runs) writes the latent part in place, q_pe is copied
    beside it; for FP8 into a query-dtype buffer first, then ``e4m3(clamp(x / q_scale))``."""
    w = f.weight
    full = out if q_scale is None else torch.empty(out.shape, dtype=a.dtype, device=a.device)
    w._run(a, w._values, w._scales, full[..., : f.latent].transpose(0, 1))
    full[..., f.latent :].copy_(q_pe)
    if q_scale is not None:
        out.copy_((full.float() / q_scale.reshape(())).clamp(-E4M3_MAX, E4M3_MAX))


def is_row_query(ql_nope: torch.Tensor, q_pe: torch.Tensor) -> bool:
    """Whether ``ql_nope [T, H, L]`` is the left part of a contiguous ``[T, H, L + R]`` row
    buffer held by its own storage (the row layout), with ``q_pe [T, H, R]`` beside it."""
    if ql_nope.dim() != 3 or q_pe.dim() != 3 or q_pe.dtype != ql_nope.dtype:
        return False
    t, h, latent = ql_nope.shape
    width = latent + q_pe.shape[2]
    if tuple(q_pe.shape[:2]) != (t, h) or ql_nope.stride(2) != 1:
        return False
    if (h > 1 and ql_nope.stride(1) != width) or (t > 1 and ql_nope.stride(0) != h * width):
        return False
    end = (ql_nope.storage_offset() + t * h * width) * ql_nope.element_size()
    return ql_nope.untyped_storage().nbytes() >= end


def row_query(ql_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor | None:
    """The whole ``[T, H, L + R]`` query when ``ql_nope`` is in the row layout: q_pe copied
    into the right part (the one copy), the left part already written by the bmm; None for
    any other layout. The caller must own the row buffer (its W_UK_T has this
    ``row_width``): the right part is overwritten."""
    if not is_row_query(ql_nope, q_pe):
        return None
    t, h, latent = ql_nope.shape
    width = latent + q_pe.shape[2]
    full = ql_nope.as_strided((t, h, width), (h * width, width, 1))
    full[..., latent:].copy_(q_pe)
    _calls["rows:copy_pe"] += 1
    return full


def calls() -> dict[str, int]:
    """Projections, late bmms and row queries served in this process (module docstring)."""
    return dict(_calls)


def reset_calls() -> None:
    """Forget the counts (tests)."""
    _calls.clear()
