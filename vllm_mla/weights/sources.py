"""kv_b_proj sources: the tensors a linear layer holds after its own post-load.

A *source* is every real tensor of the module that holds kv_b_proj's weights (a LoRA
``base_layer`` unwrapped): its parameters and buffers, ``None`` entries skipped (vLLM
registers ``bias`` as ``None``), plus any *packed owner* its kernel keeps (an attribute
holding tensors, e.g. b12x's ``b12x_mxfp8_packed_weight``). Which tensors those are, and
how they decode, is the kv_b_proj matrix (``vllm_mla.weights.forms``); this module holds
what every form shares: a chunk reader, a fingerprint, and release.

Release is a two-step transaction: ``prepare_release`` builds every placeholder and
counts the bytes (it may fail, and changes nothing); ``ReleasePlan.commit`` only
assigns (it cannot fail half-way). A released parameter keeps its object and
attributes (weight loaders) with an empty tensor of the same dtype and trailing shape
as its data, marked ``vllm_mla_released``, so vLLM's reload can fill it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from vllm_mla.weights import faults

RELEASED_ATTR = "vllm_mla_released"  # marks a placeholder left by release()
ChunkAxis = Literal["rows", "cols"]


class SourceError(ValueError):
    """kv_b_proj holds tensors this lifecycle cannot read; the message names them."""


def owner_module(kv_b_proj: nn.Module) -> nn.Module:
    """The module that actually holds the checkpoint tensors (unwraps ``base_layer``)."""
    base = getattr(kv_b_proj, "base_layer", None)
    if isinstance(base, nn.Module) and "weight" not in kv_b_proj._parameters:
        return owner_module(base)
    return kv_b_proj


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers by name, ``None`` entries skipped."""
    found = {n: t for n, t in module._parameters.items() if t is not None}
    found.update((n, t) for n, t in module._buffers.items() if t is not None)
    return found


def owner_tensors(owner: object) -> list[torch.Tensor]:
    """Tensors held by a packed owner: a tensor, a mapping, a sequence or a dataclass
    of those, walked recursively (b12x's packed weights are nested dataclasses)."""
    if isinstance(owner, torch.Tensor):
        return [owner]
    if isinstance(owner, dict):
        children = list(owner.values())
    elif isinstance(owner, list | tuple):
        children = list(owner)
    elif dataclasses.is_dataclass(owner) and not isinstance(owner, type):
        children = [getattr(owner, f.name) for f in dataclasses.fields(owner)]
    else:
        return []
    return [t for child in children for t in owner_tensors(child)]


def packed_tensors(kv_b_proj: nn.Module, attr: str) -> list[torch.Tensor]:
    """Tensors held by the packed owner ``attr`` of ``kv_b_proj`` (none when absent)."""
    return owner_tensors(getattr(owner_module(kv_b_proj), attr, None))


@dataclass(frozen=True)
class ChunkReader:
    """How a form produces pieces of the dense ``[N, K]`` weight.

    ``axis="rows"``: ``read(a, b)`` is ``W[a:b]`` (``[b - a, K]``; a head group is a row
    range). ``axis="cols"``: ``read(a, b)`` is ``W[:, a:b].T`` (``[b - a, N]``; what an
    identity slice through the layer's own GEMM returns). ``unit_bytes`` bounds the
    allocator bytes one row (or column) needs while in flight; None: not bounded by us.
    Quantized reads return float32 (or the activation dtype for ``cols``) holding exactly
    what a whole-tensor decode would hold, so chunked and whole results are identical.
    """

    axis: ChunkAxis
    read: Callable[[int, int], torch.Tensor]
    unit_bytes: int | None


@dataclass
class KVBSource:
    """The source tensors of one kv_b_proj in one form of the matrix.

    ``names``: the module's real tensors (all of them are source: MQA-only serving
    never calls kv_b_proj); ``packed``: packed-owner attributes present on it. ``dense``
    is set for unquantized forms (the weight itself, which the pair may alias).
    """

    form: str
    module: nn.Module
    shape: tuple[int, int]  # [out, in] = [N * (P + V), L] of the dequantized weight
    reader: ChunkReader
    names: tuple[str, ...]
    packed: tuple[str, ...] = ()
    dense: torch.Tensor | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return next(iter(self.tensors())).device

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this source owns: module tensors, then packed owners'."""
        table = module_tensors(self.module)
        for name in self.names:
            yield table[name]
        for attr in self.packed:
            yield from owner_tensors(getattr(self.module, attr, None))

    def fingerprint(self) -> tuple:
        """Changes whenever a source tensor is replaced or written in place."""
        held = tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in self.tensors())
        return (*held, self.names, self.packed)


def holds_weights(module: nn.Module, packed_attrs: tuple[str, ...] = ()) -> bool:
    """False when every tensor is empty and no packed owner is present (released)."""
    if any(t.numel() for t in module_tensors(module).values()):
        return True
    return any(getattr(module, a, None) is not None for a in packed_attrs)


def _empty_like(old: torch.Tensor) -> torch.Tensor:
    shape = (0, *old.shape[1:]) if old.dim() else (0,)
    return torch.empty(shape, dtype=old.dtype, device=old.device)


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())


@dataclass
class ReleasePlan:
    """Empty placeholders for every non-empty source tensor, ready to swap in.

    A parameter keeps its object (its class, ``weight_loader`` and other attributes,
    which vLLM's reload needs) and gets the placeholder as its ``.data``, as vLLM's own
    ``replace_parameter`` does; a buffer's table entry is replaced. ``commit`` only
    assigns, so it cannot stop half-way.
    """

    module: nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    packed: tuple[str, ...]
    bytes: int  # storage bytes referenced by the released tensors (deduped)

    def commit(self) -> int:
        for name, empty in self.params.items():
            param = self.module._parameters[name]
            param.data = empty
            setattr(param, RELEASED_ATTR, True)
        self.module._buffers.update(self.buffers)
        for attr in self.packed:
            setattr(self.module, attr, None)
        return self.bytes


def prepare_release(source: KVBSource) -> ReleasePlan:
    """Everything release needs, built without touching the layer (may raise)."""
    module = source.module
    params, buffers, seen = {}, {}, {}
    for name in source.names:
        faults.site("release", name)
        tensor = module_tensors(module)[name]
        if tensor.numel() == 0:
            continue  # holds nothing (e.g. a weight the kernel already emptied)
        seen[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
        table = params if name in module._parameters else buffers
        table[name] = _empty_like(tensor)
    for attr in source.packed:
        faults.site("release", attr)
        for tensor in owner_tensors(getattr(module, attr, None)):
            seen[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
    return ReleasePlan(module, params, buffers, source.packed, sum(seen.values()))
