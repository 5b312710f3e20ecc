"""Argument checks shared by the reference and the dispatcher (one contract, one place)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_mla.ops import overlap
from vllm_mla.ops.sparse_mla.formats import (
    LATENT,
    ROPE,
    ROPES,
    SparseMLAError,
    SparseMLATypeError,
    check_cache,
)

Q_DTYPES = (torch.bfloat16, torch.float32)
Query = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Args:
    """A validated call: sizes and q split into (nope, pe) views (never copied)."""

    num_tokens: int
    num_heads: int
    topk: int
    q_nope: torch.Tensor
    q_pe: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.q_nope.dtype

    @property
    def rope(self) -> int:
        """qk_rope_head_dim of the call: 64, or 0 (latent-512 MLA without RoPE)."""
        return self.q_pe.shape[-1]


def _tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], shape: tuple) -> torch.Tensor:
    """Check type, dtype, rank and shape (None = any size) of one argument."""
    if not isinstance(t, torch.Tensor):
        raise SparseMLATypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = dtypes[0] if len(dtypes) == 1 else dtypes
        raise SparseMLATypeError(f"{name}: expected dtype {want}, got {t.dtype}")
    ok = t.dim() == len(shape)
    ok = ok and all(s is None or s == n for s, n in zip(shape, t.shape, strict=True))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise SparseMLAError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    return t


def _contiguous_last(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise SparseMLAError(
            f"{name}: last dim must be contiguous (stride 1), got strides {t.stride()}"
        )


def _writable(name: str, t: torch.Tensor) -> None:
    problem = overlap.out_problem(t, name=name)
    if problem is not None:
        raise SparseMLAError(problem)


def split_q(q: Query) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, 512 + R]`` or ``(q_nope [T, H, 512], q_pe [T, H, R])`` -> two views;
    R (qk_rope_head_dim) in ``ROPES``: 64, or 0 (q_pe an empty ``[T, H, 0]``)."""
    if isinstance(q, tuple | list):
        if len(q) != 2:
            raise SparseMLAError(f"q: expected a (q_nope, q_pe) pair, got {len(q)} items")
        q_nope = _tensor("q_nope", q[0], Q_DTYPES, (None, None, LATENT))
        t, h = q_nope.shape[:2]
        rope = q[1].shape[-1] if isinstance(q[1], torch.Tensor) and q[1].dim() == 3 else ROPE
        q_pe = _tensor("q_pe", q[1], (q_nope.dtype,), (t, h, rope if rope in ROPES else ROPE))
    else:
        width = q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() == 3 else LATENT + ROPE
        rope = width - LATENT if width - LATENT in ROPES else ROPE
        q = _tensor("q", q, Q_DTYPES, (None, None, LATENT + rope))
        q_nope, q_pe = q[..., :LATENT], q[..., LATENT:]
    _contiguous_last("q_nope", q_nope)
    _contiguous_last("q_pe", q_pe)
    if q_nope.shape[1] < 1:
        raise SparseMLAError(f"q: expected H >= 1 heads, got shape {tuple(q_nope.shape)}")
    return q_nope, q_pe


def validate(
    q: Query,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    kv_format: str,
    lengths: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    invalid: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> Args:
    """Check every argument against the contract; raise a typed, named error otherwise.

    ``sink``: fp32 ``[H]`` with unit stride, one natural-log logit per head, or None."""
    q_nope, q_pe = split_q(q)
    t, h = q_nope.shape[:2]
    check_cache(kv_cache, kv_format, q_pe.shape[-1])
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        raise SparseMLAError(f"kv_cache: expected a non-empty cache, got {tuple(kv_cache.shape)}")
    _tensor("indices", indices, (torch.int32,), (t, None))
    if indices.shape[1] < 1:
        raise SparseMLAError(f"indices: expected [T={t}, K >= 1], got {tuple(indices.shape)}")
    _contiguous_last("indices", indices)
    named = [("q_pe", q_pe), ("kv_cache", kv_cache), ("indices", indices)]
    if lengths is not None:
        named.append(("lengths", _tensor("lengths", lengths, (torch.int32,), (t,))))
    if out is not None:
        named.append(("out", _tensor("out", out, (q_nope.dtype,), (t, h, LATENT))))
        _contiguous_last("out", out)
        _writable("out", out)
    if lse is not None:
        named.append(("lse", _tensor("lse", lse, (torch.float32,), (t, h))))
        _contiguous_last("lse", lse)
        _writable("lse", lse)
    if invalid is not None:
        named.append(("invalid", _tensor("invalid", invalid, (torch.int32,), (1,))))
    if sink is not None:
        named.append(("sink", _tensor("sink", sink, (torch.float32,), (h,))))
        _contiguous_last("sink", sink)
    for name, x in named:
        if x.device != q_nope.device:
            raise SparseMLAError(f"{name}: expected device {q_nope.device} (q's), got {x.device}")
    return Args(t, h, indices.shape[1], q_nope, q_pe)
