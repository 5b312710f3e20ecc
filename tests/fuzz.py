"""The fuzz harness shared by the ``test_fuzz_*.py`` files (one per op), and their rules.

Property-based fuzzing (Hypothesis) of every public op: shapes (0 and 1 where the op
allows them), strides (permuted, sliced, stepped views inside poisoned buffers), storage
offsets, dtypes and the device (CPU; CUDA too when ``torch.cuda.is_available()``).

Every example must either raise the op's typed error naming the argument at fault, or
return the op's reference within the tolerance the op's own tests use; an untyped crash
(a bare RuntimeError / IndexError / AttributeError from inside our code), a write outside
``out``, a changed input or a wrong answer fails the property.

Budgets (Hypothesis settings profiles, no deadline, no example database):

- ``ci`` (default): 20 examples per property, ``derandomize=True`` (the same examples on
  every run, so CI is deterministic). All the files take about 45 s on a 2-core CPU
  machine with the Triton kernels interpreted.
- ``full`` (``VLLM_MLA_FUZZ=full``): 500 examples per property (fewer where the input
  space is smaller), random, with shrinking and ``print_blob`` (replay a failure with
  ``@reproduce_failure``); about 8 minutes on the same machine.

No health check is suppressed: generation is cheap (tensor contents come from seeded
torch generators); only the interpreted kernels are slow, and the deadline is off.

Bugs this fuzzing found were fixed in the ops; the properties in ``test_fuzz_found.py``
are their tests, each with a comment saying what happened before the fix: ``out`` with
internal overlap (a stride-0 dim) in every op with an ``out``; ``out``
aliasing an input in absorbed_bmm and mla_query_projection; MXFP8 scales not a tensor or
on another device; an MXFP8 absorbed_bmm with N = 0; codec containers with parts on two
devices; unchecked inputs of the reference indexer; impl="triton" reading strided
lengths. No known gap is open. A new one is recorded as an ``xfail(strict=True)``
parameter naming the op, the input and what happens today, so that the fix turns it into
an XPASS failure and the mark is removed with it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st

from vllm_mla import envs
from vllm_mla.ops.base import TRITON_AVAILABLE

# --- budgets ----------------------------------------------------------------------------------

_COMMON = {"deadline": None, "database": None}
settings.register_profile("ci", max_examples=20, derandomize=True, **_COMMON)
settings.register_profile("full", max_examples=500, print_blob=True, **_COMMON)
PROFILE = "full" if os.environ.get("VLLM_MLA_FUZZ") == "full" else "ci"
FUZZ = settings.get_profile(PROFILE)

# --- devices ----------------------------------------------------------------------------------

CUDA = torch.cuda.is_available()
DEVICES = ("cpu", "cuda") if CUDA else ("cpu",)
TRITON = TRITON_AVAILABLE
# Where the Triton kernels run: CUDA, else the CPU interpreter (tests/conftest.py sets it).
TRITON_DEVICES = (
    ("cuda",) if CUDA and TRITON else (("cpu",) if TRITON and envs.triton_interpret() else ())
)
needs_triton = pytest.mark.skipif(not TRITON_DEVICES, reason="needs Triton (CUDA or interpreter)")


def other_device(device: str) -> str:
    """A device that differs from ``device`` (meta stands in for a second device on CPU)."""
    if device == "cuda":
        return "cpu"
    return "cuda" if CUDA else "meta"


BF16, F32 = torch.bfloat16, torch.float32
E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
seeds = st.integers(0, 2**31 - 1)
devices = st.sampled_from(DEVICES)


def randn(seed: int, shape, dtype=F32, device="cpu", scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


# --- views inside poisoned buffers ------------------------------------------------------------


def _fill(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A flat buffer of poison: NaN for floats (0xFF bytes for 1-byte types), 0 for ints
    (a valid row / length, so a stray read changes the answer)."""
    if dtype.itemsize == 1:
        return torch.full((n,), 0xFF, dtype=torch.uint8, device=device).view(dtype)
    if dtype.is_floating_point:
        return torch.full((n,), float("nan"), dtype=dtype, device=device)
    return torch.zeros(n, dtype=dtype, device=device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@dataclass(frozen=True)
class Layout:
    """Memory order of the dims, padding and step per dim, and a storage offset."""

    order: tuple[int, ...]
    pads: tuple[int, ...]
    steps: tuple[int, ...]
    offset: int


def layout(draw, ndim: int, *, last: bool = True) -> Layout:
    """A random layout; ``last`` keeps the last dim innermost with stride 1."""
    lead = ndim - 1 if last and ndim else ndim
    order = (*draw(st.permutations(range(lead))), *range(lead, ndim))
    pads = tuple(draw(st.integers(0, 2)) for _ in range(ndim))
    steps = [draw(st.integers(1, 2)) for _ in range(ndim)]
    if last and ndim:
        steps[-1] = 1
    return Layout(order, pads, tuple(steps), draw(st.integers(0, 3)))


class Placed:
    """``x``'s values in a view with a drawn layout inside a larger poisoned buffer; remembers
    the buffer's bytes to prove nothing outside the view (or, for inputs, nothing) changed."""

    def __init__(self, x: torch.Tensor, lay: Layout):
        shape = tuple(x.shape)
        mem = [(shape[d] + lay.pads[d]) * lay.steps[d] for d in lay.order]
        size = lay.offset + math.prod(mem)
        self.buffer = _fill(size, x.dtype, x.device)
        self.view = self._carve(self.buffer, shape, mem, lay)
        _bytes(self.view).copy_(_bytes(x))
        where = self._carve(torch.arange(size, device=x.device), shape, mem, lay)
        inside = torch.zeros(size, dtype=torch.bool, device=x.device)
        inside[where.reshape(-1)] = True
        self._outside = (~inside).repeat_interleave(x.element_size())
        self._before = self.buffer.view(torch.uint8).clone()

    @staticmethod
    def _carve(flat, shape, mem, lay: Layout) -> torch.Tensor:
        t = flat[lay.offset :].view(mem)
        t = t[tuple(slice(0, shape[d] * lay.steps[d], lay.steps[d]) for d in lay.order)]
        return t.permute(*[lay.order.index(d) for d in range(len(shape))])

    def assert_outside_untouched(self) -> None:
        now = self.buffer.view(torch.uint8)
        assert torch.equal(now[self._outside], self._before[self._outside]), "wrote outside"

    def assert_unchanged(self) -> None:
        assert torch.equal(self.buffer.view(torch.uint8), self._before), "an input changed"


def place(draw, x: torch.Tensor, *, last: bool = True) -> Placed:
    return Placed(x, layout(draw, x.dim(), last=last))


def poison(shape, dtype, device) -> torch.Tensor:
    return _fill(math.prod(shape), dtype, device).view(shape)


# --- tolerances (the ops' own tests) ----------------------------------------------------------

_MANTISSA = {BF16: 8, torch.float16: 11, F32: 24}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |x| (float64), floored at the dtype's smallest subnormal."""
    _, exponent = torch.frexp(x.double().abs())
    spacing = torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - _MANTISSA[dtype])
    return spacing.clamp(min=torch.finfo(dtype).smallest_normal * 2.0 ** -_MANTISSA[dtype])


def assert_gemm_close(got: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
    """``got`` vs the exact ``a @ w`` (float64, batched): the fp32 summation-order bound
    ``K * 2**-23 * sum|a w|`` plus one ulp of ``got``'s dtype (bf16 / fp16), as
    tests/test_absorbed_bmm.py and tests/test_query_projection.py allow."""
    want = torch.matmul(a.double(), w.double())
    terms = torch.matmul(a.double().abs(), w.double().abs())
    # one fp32 sum of K terms, any order: <= K * 2**-24 of sum|terms|; 2**-23 leaves 2x
    tol = a.shape[-1] * 2.0**-23 * terms
    if got.dtype != F32:  # one rounding to bf16 / fp16: half an ulp; a whole one leaves 2x
        tol = tol + ulp(torch.maximum(got.double().abs(), want.abs()), got.dtype)
    assert got.shape == want.shape
    assert ((got.double() - want).abs() <= tol).all(), (got.double() - want).abs().max()


def e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """Spacing of float8_e4m3fn at |x| (3 mantissa bits, subnormal step 2**-9)."""
    _, exponent = torch.frexp(x.double().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 4).clamp(min=2.0**-9)


def wider_last(t: torch.Tensor) -> torch.Tensor:
    """Same shape, last dim strided (stride 2)."""
    return torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)[..., ::2]


def resized(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A tensor like ``t`` with one more element along ``dim``."""
    shape = list(t.shape)
    shape[dim] += 1
    return torch.empty(shape, dtype=t.dtype, device=t.device)


def assert_refused(call, errors, named: str):
    """``call()`` raises one of ``errors`` whose message names the argument (``named``);
    any other exception propagates and fails the property."""
    with pytest.raises(errors) as info:
        call()
    assert named in str(info.value), f"{named!r} not named in: {info.value}"
