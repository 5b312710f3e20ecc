"""kv_b_proj source owners: read the checkpoint tensors, dequantize row chunks, release.

A *source* is what the checkpoint loaded into ``kv_b_proj``: a dense weight, a
block-FP8 pair (``weight`` + ``weight_scale_inv``) or an MXFP8 pair (``weight`` +
``weight_scale``). A *packed* owner is anything a backend derived from it (held on
``kv_b_proj`` under a name in ``PACKED_ATTRS``). Both can be released once the
absorbed pair holds the weights; release swaps each tensor for an empty placeholder
of the same dtype and trailing shape, keeping the parameter's attributes (weight
loaders) so the loader can fill it again on reload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from vllm_mla.quant import fp8_block, mxfp8

SourceFormat = Literal["dense", "fp8-block", "mxfp8", "external"]

FP8_DTYPES = (torch.float8_e4m3fn,)
DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PACKED_ATTRS = ("vllm_mla_packed",)


class SourceError(ValueError):
    """kv_b_proj holds tensors this lifecycle cannot read; the message names them."""


def owner_module(kv_b_proj: nn.Module) -> nn.Module:
    """The module that actually holds the checkpoint tensors (unwraps ``base_layer``)."""
    base = getattr(kv_b_proj, "base_layer", None)
    if isinstance(base, nn.Module) and "weight" not in kv_b_proj._parameters:
        return owner_module(base)
    return kv_b_proj


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    value = module._parameters.get(name)
    if value is None:
        value = module._buffers.get(name)
    return value


@dataclass
class KVBSource:
    """The checkpoint tensors of one kv_b_proj, in one of the supported formats.

    ``names[0]`` is the weight; for block FP8 and MXFP8 ``names[1]`` is its scale.
    ``external`` sources (a quant method only its owner can decode) carry a
    ``dequant`` callable returning the whole ``external_shape`` = ``[out, in]``
    weight; they are materialized in one chunk, with no scratch bound.
    """

    fmt: SourceFormat
    module: nn.Module
    names: tuple[str, ...]
    dequant: Callable[[], torch.Tensor] | None = None
    external_shape: tuple[int, int] | None = None

    @property
    def weight(self) -> torch.Tensor:
        return _tensor(self.module, self.names[0])

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(_tensor(self.module, n) for n in self.names)

    @property
    def shape(self) -> tuple[int, int]:
        """``[out, in]`` of the dequantized weight."""
        return self.external_shape or tuple(self.weight.shape)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def fingerprint(self) -> tuple:
        """Changes whenever a source tensor is replaced or written in place."""
        return tuple(
            (n, t.data_ptr(), t._version, tuple(t.shape), t.dtype)
            for n, t in zip(self.names, self.tensors, strict=True)
        )

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the weight, ``[stop - start, L]``.

        Dense sources return a view in their own dtype (no copy); quantized ones
        return an fp32 tensor holding exactly what a whole-tensor fp32 dequant
        would hold for those rows, so chunked and whole results are bit-identical.
        """
        if self.fmt == "dense":
            return self.weight[start:stop]
        if self.fmt == "external":
            full = self.dequant()
            if tuple(full.shape) != self.shape:
                raise SourceError(
                    f"kv_b_proj dequantized to {tuple(full.shape)}, expected {self.shape}"
                )
            return full[start:stop]
        scale = _tensor(self.module, self.names[1])
        if self.fmt == "fp8-block":
            packed = fp8_block.FP8BlockTensor(self.weight, scale)
            return fp8_block.dequantize(packed, torch.float32, rows=slice(start, stop))
        scales = scale
        if scales.dtype != torch.uint8:
            scales = scales.view(torch.uint8)
        packed = mxfp8.MXFP8Tensor(self.weight, scales, axis=1)
        return mxfp8.dequantize(packed.narrow(0, start, stop - start), torch.float32)

    def scratch_bytes_per_row(self) -> int | None:
        """Upper bound of allocator bytes one dequantized row needs while in flight.

        Dense: 0 (views). External: None (unbounded). Quantized: the codecs widen
        the values to fp32 and scale them in place (4 bytes per element), plus
        gathered per-block scales and their indices (at most 12 bytes per 32
        elements) and a little slack.
        """
        if self.fmt == "dense":
            return 0
        if self.fmt == "external":
            return None  # the owner's dequant decides; not bounded by us
        cols = self.shape[1]
        return 4 * cols + 12 * -(-cols // mxfp8.BLOCK_SIZE) + 64


def read_source(kv_b_proj: nn.Module) -> KVBSource | None:
    """The source held by ``kv_b_proj``; None when it was released (empty placeholders).

    Raises SourceError naming the tensors when the format is not one we read.
    """
    module = owner_module(kv_b_proj)
    weight = _tensor(module, "weight")
    if weight is None:
        found = sorted({*module._parameters, *module._buffers})
        raise SourceError(
            f"kv_b_proj ({type(kv_b_proj).__name__}) has no 'weight' tensor; found {found}"
        )
    if weight.numel() == 0:
        return None
    if weight.dim() != 2:
        raise SourceError(
            f"kv_b_proj.weight must be 2-D [out, in], got shape {tuple(weight.shape)}"
        )
    if weight.dtype in DENSE_DTYPES:
        return KVBSource("dense", module, ("weight",))
    if weight.dtype not in FP8_DTYPES:
        raise SourceError(
            f"kv_b_proj.weight has dtype {weight.dtype}; expected one of "
            f"{[*DENSE_DTYPES, *FP8_DTYPES]}"
        )
    out, cols = weight.shape
    scale_inv = _tensor(module, "weight_scale_inv")
    if scale_inv is not None:
        want = (-(-out // 128), -(-cols // 128))
        if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
            raise SourceError(
                f"kv_b_proj.weight_scale_inv: expected float32 {want}, "
                f"got {scale_inv.dtype} {tuple(scale_inv.shape)}"
            )
        return KVBSource("fp8-block", module, ("weight", "weight_scale_inv"))
    scale = _tensor(module, "weight_scale")
    if scale is not None:
        want = (out, cols // mxfp8.BLOCK_SIZE)
        if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu) or tuple(scale.shape) != want:
            raise SourceError(
                f"kv_b_proj.weight_scale (MXFP8): expected uint8 or float8_e8m0fnu {want}, "
                f"got {scale.dtype} {tuple(scale.shape)}"
            )
        return KVBSource("mxfp8", module, ("weight", "weight_scale"))
    raise SourceError(
        "kv_b_proj.weight is float8_e4m3fn but neither weight_scale_inv (block FP8) "
        "nor weight_scale (MXFP8) is present"
    )


RELEASED_ATTR = "vllm_mla_released"  # marks a placeholder left by release()


def _placeholder(old: torch.Tensor) -> torch.Tensor:
    empty = torch.empty((0, *old.shape[1:]), dtype=old.dtype, device=old.device)
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(empty, requires_grad=False)
        new.__dict__.update(old.__dict__)  # keep weight_loader and friends for reload
        setattr(new, RELEASED_ATTR, True)
        return new
    return empty


def release(source: KVBSource, kv_b_proj: nn.Module) -> int:
    """Swap the source tensors and any packed owner for empty placeholders.

    Returns the storage bytes that were referenced (deduped); they are freed when
    no one else holds them. The caller must drop ``source`` afterwards.
    """
    seen: dict[tuple, int] = {}
    for name, tensor in zip(source.names, source.tensors, strict=True):
        seen[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
        table = (
            source.module._parameters
            if name in source.module._parameters
            else source.module._buffers
        )
        table[name] = _placeholder(tensor)
    for attr in PACKED_ATTRS:
        for tensor in packed_tensors(kv_b_proj, attr):
            seen[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
        if getattr(kv_b_proj, attr, None) is not None:
            setattr(kv_b_proj, attr, None)
    return sum(seen.values())


def packed_tensors(kv_b_proj: nn.Module, attr: str) -> list[torch.Tensor]:
    """Tensors held by a packed owner: a tensor, a mapping or a sequence of tensors."""
    owner = getattr(kv_b_proj, attr, None)
    if owner is None:
        return []
    if isinstance(owner, torch.Tensor):
        return [owner]
    values = owner.values() if isinstance(owner, dict) else owner
    return [t for t in values if isinstance(t, torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.device, tensor.untyped_storage().data_ptr())
