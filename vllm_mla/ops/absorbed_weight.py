"""``AbsorbedWeight``: W_UK_T / W_UV as a tensor whose ``torch.bmm`` runs our op.

vLLM computes the absorptions inline (``torch.bmm(q, self.W_UK_T, out=...)`` in
``MLAAttention.forward_impl``, ``DeepseekV32Attention.forward`` and
``_sparse_indexer_and_attn``), so there is no method to patch. A wrapper tensor
subclass (the way torchao's quantized tensors flow through unmodified model code)
carries the matmul with the weight instead:

- ``kind == "dense"``: wraps the BF16 (or activation-dtype) pair; bmm runs the
  bounds-safe op (``safe`` mode).
- ``kind == "mxfp8"``: wraps e4m3 values and E8M0 scales, views into kv_b_proj's
  MXFP8 pack, with the logical shape ``[H, P, L]`` / ``[H, L, V]`` and the activation
  dtype (``direct`` mode: no BF16 pair exists).

Routes: eager ``torch.bmm`` / ``Tensor.bmm`` with the weight second go straight to
``ops.absorbed_matmul.dispatch.run_checked`` from ``__torch_function__`` (no dispatcher round trip);
under torch.compile the call reaches ``__torch_dispatch__`` as ``aten.bmm`` and becomes
the opaque custom op. ``detach``/``alias`` keep the wrapper (``nn.Parameter`` needs
it); in-place ops on a dense wrapper write its storage; anything else runs on the
dense values (an MXFP8 weight is decoded for it, and refuses in-place writes: the pack
is refreshed by its owner). The wrapper's strides are contiguous by construction;
``inner_tensors()`` is the storage it really holds (for ledgers and pointer checks).

Two optional bindings ride along (``vllm_mla.vllm.fused_query`` sets them): ``path`` fixes
the bmm's path (``torch``: upstream's ``torch.bmm``, for a weight routed only for the next
two), ``row_width`` makes a bmm without ``out`` return the row layout
(``absorbed_matmul.dispatch.new_out``: the DSA query), and ``attach_fusion`` lets an eager
``torch.bmm(q, W, out=...)`` defer to the layer's query projection
(``vllm_mla.ops.query_fusion``) while that layer is armed. Any other eager bmm on a routed
weight first runs a deferred bmm nobody took.
"""

from __future__ import annotations

import logging

import torch
from torch.utils._pytree import tree_map_only

from vllm_mla.ops import query_fusion
from vllm_mla.ops.absorbed_matmul.api import validate
from vllm_mla.ops.absorbed_matmul.dispatch import PATHS, plan_path, run_checked, runner
from vllm_mla.ops.absorbed_matmul.reference import decode
from vllm_mla.ops.base import MXFP8Weight

logger = logging.getLogger("vllm_mla")
aten = torch.ops.aten

_BMM, _TENSOR_BMM = torch.bmm, torch.Tensor.bmm
_KEEP_WRAPPER = (aten.detach.default, aten.alias.default)
_logged_fallbacks: set[str] = set()


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class AbsorbedWeight(torch.Tensor):
    """An absorbed MLA weight ``[B, K, N]`` whose bmm is ``vllm_mla.ops.absorbed_matmul``."""

    _values: torch.Tensor
    _scales: torch.Tensor | None
    role: str

    @staticmethod
    def __new__(
        cls,
        values: torch.Tensor,
        scales: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        role: str = "",
        path: str | None = None,
        row_width: int = 0,
    ):
        dtype = dtype or values.dtype
        probe = torch.empty(
            (values.shape[0], 0, values.shape[1]), dtype=dtype, device=values.device
        )
        validate(probe, values if scales is None else MXFP8Weight(values, scales), None)
        return torch.Tensor._make_wrapper_subclass(
            cls,
            values.shape,
            strides=_contiguous_strides(values.shape),
            dtype=dtype,
            device=values.device,
            requires_grad=False,
        )

    def __init__(
        self,
        values: torch.Tensor,
        scales: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        role: str = "",
        path: str | None = None,
        row_width: int = 0,
    ) -> None:
        self._values = values
        self._scales = scales
        self._dtype = dtype or values.dtype  # plain attributes: Tensor.dtype costs a dispatch
        self.role = role
        planned = plan_path(values, scales, self._dtype)
        if path is not None and path != planned:
            if path not in PATHS or (scales is None) != (path in ("safe", "torch")):
                raise ValueError(f"path {path!r} cannot serve a {self.kind} weight")
            planned = path
        if row_width and row_width < values.shape[2]:
            raise ValueError(f"row_width {row_width} < N={values.shape[2]}")
        self._path_fixed = path is not None
        self._run = runner(planned, values.device.type)
        self._key = (planned, role)
        self._dims = (*values.shape, values.get_device(), self._dtype)
        self._row_width = row_width
        self._fusion: query_fusion.QueryFusion | None = None

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def dense(
        cls, tensor: torch.Tensor, role: str = "", path: str | None = None, row_width: int = 0
    ) -> AbsorbedWeight:
        """Wrap a dense pair member (its storage is used as is, never copied)."""
        if isinstance(tensor, AbsorbedWeight):
            tensor = tensor.dense_values()
        return cls(tensor, None, tensor.dtype, role, path, row_width)

    def rebound(self, *, path: str | None = None, row_width: int = 0) -> AbsorbedWeight:
        """The same storage and dtype with another ``path`` / ``row_width`` (never copied)."""
        return AbsorbedWeight(
            self._values, self._scales, self._dtype, self.role, path or self.path, row_width
        )

    def attach_fusion(self, fusion: query_fusion.QueryFusion | None) -> None:
        """Let eager ``torch.bmm(q, self, out=...)`` defer to ``fusion`` while it is armed."""
        self._fusion = fusion

    @classmethod
    def mxfp8(cls, weight: MXFP8Weight, dtype: torch.dtype, role: str = "") -> AbsorbedWeight:
        """Wrap MXFP8 views (values e4m3, scales along K or N) as a ``dtype`` weight."""
        scales = weight.scales
        if scales.dtype != torch.uint8:
            scales = scales.view(torch.uint8)
        return cls(weight.values, scales, dtype, role)

    # -- what it holds ---------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return "dense" if self._scales is None else "mxfp8"

    @property
    def path(self) -> str:
        """The path every bmm on this weight takes (``absorbed_matmul.dispatch.PATHS``)."""
        return self._key[0]

    @property
    def row_width(self) -> int:
        """W > 0: a bmm without ``out`` returns the row layout (module docstring)."""
        return self._row_width

    @property
    def fusion(self) -> query_fusion.QueryFusion | None:
        return self._fusion

    @property
    def weight(self) -> torch.Tensor | MXFP8Weight:
        """What ``absorbed_bmm`` takes: the dense tensor or the MXFP8 pair."""
        if self._scales is None:
            return self._values
        return MXFP8Weight(self._values, self._scales)

    def inner_tensors(self) -> list[torch.Tensor]:
        """The tensors whose storage this weight holds (values, then scales)."""
        return [self._values] if self._scales is None else [self._values, self._scales]

    def dense_values(self) -> torch.Tensor:
        """The weight as a plain tensor: the wrapped one, or a decoded copy for MXFP8."""
        if self._scales is None:
            return self._values
        return decode(MXFP8Weight(self._values, self._scales), self.dtype)

    def __repr__(self) -> str:  # never touches the data through dispatch
        return (
            f"AbsorbedWeight({self.role or 'weight'}, {self.kind}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, values={self._values.dtype})"
        )

    # -- tracing support -------------------------------------------------------------------

    def _stable_hash_for_caching(self) -> str:
        return (
            f"AbsorbedWeight:{self.kind}:{self.role}:{self.dtype}:{tuple(self.shape)}:"
            f"{self._key[0]}:{self._row_width}"
        )

    def __tensor_flatten__(self):
        names = ["_values"] if self._scales is None else ["_values", "_scales"]
        path = self._key[0] if self._path_fixed else None
        return names, (self.dtype, self.role, path, self._row_width)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        dtype, role, path, row_width = ctx
        return AbsorbedWeight(inner["_values"], inner.get("_scales"), dtype, role, path, row_width)

    # -- routing ---------------------------------------------------------------------------

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if (
            (func is _BMM or func is _TENSOR_BMM)
            and len(args) == 2
            and type(args[1]) is AbsorbedWeight
            and not isinstance(args[0], AbsorbedWeight)
            and not torch.compiler.is_compiling()
        ):
            w, out = args[1], kwargs.get("out") if kwargs else None
            fusion = w._fusion
            if fusion is not None and out is not None and fusion.defer(args[0], out):
                return out  # the layer's query projection computes it (query_fusion)
            if query_fusion.pending():
                query_fusion.flush_pending("unclaimed")
            return run_checked(w, args[0], out)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.bmm.default, aten.bmm.out) and _weight_second(args):
            a, w = args
            values, scales = w._values, w._scales
            path = w._key[0] if w._path_fixed else ""
            if func is aten.bmm.default:
                return torch.ops.vllm_mla.absorbed_bmm(
                    a, values, scales, w.role, path, w._row_width
                )
            out = kwargs["out"]
            torch.ops.vllm_mla.absorbed_bmm_out(a, values, scales, out, w.role, path)
            return out
        if func in _KEEP_WRAPPER:
            w = args[0]
            path = w._key[0] if w._path_fixed else None
            kept = AbsorbedWeight(w._values, w._scales, w._dtype, w.role, path, w._row_width)
            kept._fusion = w._fusion
            return kept
        if func is aten.copy_.default and isinstance(args[0], AbsorbedWeight):
            return _copy_into(args[0], args[1])
        if func._schema.is_mutable and any(
            isinstance(t, AbsorbedWeight) and t.kind == "mxfp8" for t in (*args, *kwargs.values())
        ):
            raise TypeError(
                f"{func}: an MXFP8 absorbed weight is a read-only view of kv_b_proj's pack; "
                "refresh the pack instead (the lifecycle does on reload)"
            )
        _log_fallback_once(func)
        unwrap = lambda t: t.dense_values()  # noqa: E731
        return func(
            *tree_map_only(AbsorbedWeight, unwrap, args),
            **tree_map_only(AbsorbedWeight, unwrap, kwargs),
        )


def _copy_into(dst: AbsorbedWeight, src: object) -> AbsorbedWeight:
    """``dst.copy_(src)``: what vLLM's reload does to every kept parameter.

    Dense: the wrapped storage is written. MXFP8: a copy from views of the same storage
    is a no-op, from another MXFP8 weight of the same layout a copy of values and scales;
    anything else would need quantization and is refused.
    """
    if dst.kind == "dense":
        dst._values.copy_(src.dense_values() if isinstance(src, AbsorbedWeight) else src)
        return dst
    if isinstance(src, AbsorbedWeight) and src.kind == "mxfp8":
        pairs = ((dst._values, src._values), (dst._scales, src._scales))
        if all(d.shape == s.shape for d, s in pairs):
            for d, s in pairs:
                if d.data_ptr() != s.data_ptr() or d.stride() != s.stride():
                    d.copy_(s)
            return dst
    raise TypeError(
        f"copy_ into an MXFP8 absorbed weight {tuple(dst.shape)} from "
        f"{type(src).__name__}: only another MXFP8 weight of the same layout can be copied "
        "(the pack is refreshed by the lifecycle)"
    )


def _weight_second(args: tuple) -> bool:
    return (
        len(args) == 2
        and isinstance(args[1], AbsorbedWeight)
        and not isinstance(args[0], AbsorbedWeight)
    )


def _log_fallback_once(func) -> None:
    name = str(func)
    if name not in _logged_fallbacks:
        _logged_fallbacks.add(name)
        logger.debug("AbsorbedWeight: %s runs on the dense values", name)


def unwrap(tensor: object) -> object:
    """The dense storage behind a dense ``AbsorbedWeight``; anything else unchanged."""
    if isinstance(tensor, AbsorbedWeight) and tensor.kind == "dense":
        return tensor._values
    return tensor
