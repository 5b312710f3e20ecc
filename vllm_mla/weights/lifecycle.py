"""The lifecycle's shared core: settings, errors, the state kept on a layer, the report,
and the two helpers every mode uses (the layer's geometry, binding a parameter).

Imported by the BF16 mode (``absorb``), the direct mode (``direct``) and the model of
upstream (``upstream``); it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from vllm_mla.weights import faults, forms
from vllm_mla.weights.sources import ChunkAxis, KVBSource

DEFAULT_MAX_SCRATCH_BYTES = 8 << 20  # 8 MiB: a few heads at any preset's geometry
STATE_ATTR = "_vllm_mla_absorbed"
PAIR = ("W_UK_T", "W_UV")
ABSORBED_MODES = ("bf16", "direct")
MATERIALIZE = "absorbed-pair materialization"
SOURCE_KEPT = "kv_b_proj's source intact, nothing released"


class LifecycleError(RuntimeError):
    """The lifecycle cannot proceed; the message says which setting or tensor is at fault."""


class ReleaseRefusedError(LifecycleError):
    """Release was asked for while a dense MHA prefill path still calls kv_b_proj."""


class PostLoadError(LifecycleError):
    """Post-load failed part-way and changed nothing: it can be retried.

    ``step`` is the last lifecycle step reached (an allocation, copy, dequantization chunk
    or release, as the fault seam names it), ``layer`` the vLLM layer when the caller knows
    it; the original error is ``__cause__``.
    """

    def __init__(
        self, what: str, kept: str, step: str | None, cause: str, layer: str | None = None
    ) -> None:
        super().__init__(what, kept, step, cause, layer)
        self.what, self.kept, self.step, self.cause, self.layer = what, kept, step, cause, layer

    @classmethod
    def after(cls, what: str, kept: str, exc: BaseException) -> PostLoadError:
        """The error for ``exc`` raised inside ``what``, at the seam's last step."""
        return cls(what, kept, faults.last_step(), f"{type(exc).__name__}: {exc}")

    def __str__(self) -> str:
        of = f" of {self.layer}" if self.layer else ""
        at = f" at {self.step}" if self.step else ""
        return (
            f"vllm-mla: {self.what}{of} failed{at} ({self.cause}); every tensor of the layer "
            f"is as it was ({self.kept}); post-load can be retried"
        )


@dataclass(frozen=True)
class LifecycleConfig:
    """How post-load treats one layer.

    ``release_source`` frees kv_b_proj's checkpoint tensors (and packed owners)
    after the pair is materialized; it is refused while ``dense_mha_prefill`` is
    True, because that prefill path calls kv_b_proj. ``max_scratch_bytes`` bounds
    dequantization scratch; the lifecycle picks the largest head group that fits.
    ``absorbed="direct"`` binds MXFP8 views of the pack instead of a BF16 pair
    (``vllm_mla.weights.direct``; release then frees only what the views do not read).
    """

    release_source: bool = False
    dense_mha_prefill: bool = True
    max_scratch_bytes: int = DEFAULT_MAX_SCRATCH_BYTES
    absorbed: Literal["bf16", "direct"] = "bf16"

    def __post_init__(self) -> None:
        if self.max_scratch_bytes <= 0:
            raise LifecycleError(f"max_scratch_bytes must be > 0, got {self.max_scratch_bytes}")
        if self.absorbed not in ABSORBED_MODES:
            raise LifecycleError(f"absorbed must be one of {ABSORBED_MODES}, got {self.absorbed!r}")

    def check_release(self) -> None:
        """Raise ReleaseRefusedError if release is asked for while MHA prefill needs the source."""
        if self.release_source and self.dense_mha_prefill:
            raise ReleaseRefusedError(
                "release_source=True refused: a dense MHA prefill path is active and calls "
                "kv_b_proj, so its checkpoint tensors must stay (use an MQA-only backend or "
                "keep release_source=False)"
            )


@dataclass(frozen=True)
class AbsorptionPlan:
    """Shapes and bytes of the persistent pair and of the scratch; allocates nothing.

    ``axis`` says what a chunk is: a group of heads (rows of kv_b_proj) or, for layouts
    read through the layer's own GEMM, a group of latent columns (identity rows).
    """

    num_heads: int
    nope_dim: int
    v_dim: int
    latent_dim: int
    dtype: torch.dtype
    device: torch.device
    axis: ChunkAxis
    per_chunk: int  # heads (axis "rows") or latent columns (axis "cols") per chunk
    scratch_bound_bytes: int | None  # None: the kernel's own scratch is not bounded here

    @property
    def shapes(self) -> dict[str, tuple[int, int, int]]:
        n, p, v, lat = self.num_heads, self.nope_dim, self.v_dim, self.latent_dim
        return {"W_UK_T": (n, p, lat), "W_UV": (n, lat, v)}

    @property
    def pair_bytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(a * b * c for a, b, c in self.shapes.values()) * size

    @property
    def heads_per_chunk(self) -> int:
        return self.per_chunk if self.axis == "rows" else self.num_heads

    @property
    def chunks(self) -> list[tuple[int, int]]:
        total = self.num_heads if self.axis == "rows" else self.latent_dim
        step = self.per_chunk
        return [(i, min(i + step, total)) for i in range(0, total, step)]


@dataclass
class AbsorbedState:
    """What the last *successful* post-load left on a layer (kept on the layer).

    ``fingerprint`` identifies the source it materialized from (None: never
    succeeded), so a failed attempt is never mistaken for a finished one.
    """

    fingerprint: tuple | None = None
    released: bool = False
    direct: object | None = None  # direct.DirectState once direct mode bound the views


@dataclass
class PostLoadReport:
    """What one post-load call did."""

    action: Literal["materialized", "reloaded", "aliased", "noop", "direct", "direct-reloaded"]
    pair: dict[str, str] = field(default_factory=dict)
    released_bytes: int = 0
    plan: AbsorptionPlan | None = None


def layer_dims(layer: nn.Module) -> tuple[int, int, int, int]:
    """(N, P, V, L) read from the layer's vLLM-named attributes."""
    dims = []
    for name in ("num_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"):
        value = getattr(layer, name, None)
        if not isinstance(value, int) or value <= 0:
            raise LifecycleError(f"layer.{name} must be a positive int, got {value!r}")
        dims.append(value)
    return tuple(dims)


def state_of(layer: nn.Module) -> AbsorbedState:
    """The lifecycle state kept on ``layer`` (created empty on first use)."""
    state = layer.__dict__.get(STATE_ATTR)
    if state is None:
        state = AbsorbedState()
        layer.__dict__[STATE_ATTR] = state
    return state


def default_reader(act_dtype: torch.dtype) -> Callable[[nn.Module], KVBSource | None]:
    """The core reader: kv_b_proj's form detected from the matrix (``forms``)."""
    return lambda kv_b_proj: forms.read_source(kv_b_proj, act_dtype)


def bind_parameter(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``tensor`` the storage of parameter ``name`` (vLLM expects nn.Parameters here).

    An existing Parameter object is kept and rebound, as vLLM's replace_parameter does,
    so references held by the reload machinery (and its loader attributes) survive.
    """
    current = layer._parameters.get(name)
    if current is tensor:
        return
    if isinstance(current, nn.Parameter):
        current.data = tensor
        return
    layer.__dict__.pop(name, None)
    layer._buffers.pop(name, None)
    layer._parameters[name] = nn.Parameter(tensor, requires_grad=False)
