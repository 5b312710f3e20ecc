"""The absorbed-weight lifecycle: plan -> preallocate -> materialize -> release -> reload.

``post_load(layer, act_dtype, config)`` turns ``layer.kv_b_proj`` into the
contiguous absorbed pair ``layer.W_UK_T [N, P, L]`` and ``layer.W_UV [N, L, V]``:

1. plan the pair and a bounded scratch (head groups);
2. preallocate the pair before any scratch exists (or reuse compatible storage
   in place on reload, so CUDA-graph addresses never move);
3. dequantize head group by head group straight into the pair;
4. release the source only when the config allows it, after step 3 succeeded.

A failure anywhere leaves the source intact, binds nothing new and marks the
layer for a full retry. Running it again with nothing new is a no-op.
A dense source already in the activation dtype that must stay is not copied: the
pair is bound as views of it, exactly as upstream does ("aliased"; a copy would only
add bytes).
``baseline_post_load`` reproduces upstream vLLM 0.33 for side-by-side measurement.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from vllm_mla.quant import mxfp8
from vllm_mla.weights import sources
from vllm_mla.weights.device import resolve_device
from vllm_mla.weights.sources import KVBSource

logger = logging.getLogger("vllm_mla")

FP8_BLOCK = 128  # DeepSeek block-FP8 scale granularity (rows and columns)
DEFAULT_MAX_SCRATCH_BYTES = 8 << 20  # 8 MiB: a few heads at any preset's geometry
STATE_ATTR = "_vllm_mla_absorbed"
PAIR = ("W_UK_T", "W_UV")


class LifecycleError(RuntimeError):
    """The lifecycle cannot proceed; the message says which setting or tensor is at fault."""


class ReleaseRefusedError(LifecycleError):
    """Release was asked for while a dense MHA prefill path still calls kv_b_proj."""


@dataclass(frozen=True)
class LifecycleConfig:
    """How post-load treats one layer.

    ``release_source`` frees kv_b_proj's checkpoint tensors (and packed owners)
    after the pair is materialized; it is refused while ``dense_mha_prefill`` is
    True, because that prefill path calls kv_b_proj. ``max_scratch_bytes`` bounds
    dequantization scratch; the lifecycle picks the largest head group that fits.
    """

    release_source: bool = False
    dense_mha_prefill: bool = True
    max_scratch_bytes: int = DEFAULT_MAX_SCRATCH_BYTES

    def __post_init__(self) -> None:
        if self.max_scratch_bytes <= 0:
            raise LifecycleError(f"max_scratch_bytes must be > 0, got {self.max_scratch_bytes}")

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
    """Shapes and bytes of the persistent pair and of the scratch; allocates nothing."""

    num_heads: int
    nope_dim: int
    v_dim: int
    latent_dim: int
    dtype: torch.dtype
    device: torch.device
    heads_per_chunk: int
    scratch_bound_bytes: int | None  # None: an external dequant, not bounded here

    @property
    def shapes(self) -> dict[str, tuple[int, int, int]]:
        n, p, v, lat = self.num_heads, self.nope_dim, self.v_dim, self.latent_dim
        return {"W_UK_T": (n, p, lat), "W_UV": (n, lat, v)}

    @property
    def pair_bytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(a * b * c for a, b, c in self.shapes.values()) * size

    @property
    def chunks(self) -> list[tuple[int, int]]:
        step = self.heads_per_chunk
        return [(h, min(h + step, self.num_heads)) for h in range(0, self.num_heads, step)]


@dataclass
class AbsorbedState:
    """What the last *successful* post-load left on a layer (kept on the layer).

    ``fingerprint`` identifies the source it materialized from (None: never
    succeeded), so a failed attempt is never mistaken for a finished one.
    """

    fingerprint: tuple | None = None
    released: bool = False


@dataclass
class PostLoadReport:
    """What one post-load call did."""

    action: Literal["materialized", "reloaded", "aliased", "noop"]
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


def plan_absorption(
    layer: nn.Module, source: KVBSource, act_dtype: torch.dtype, config: LifecycleConfig
) -> AbsorptionPlan:
    """Plan for ``layer``; checks the source shape against the layer's geometry."""
    n, p, v, lat = layer_dims(layer)
    expected = (n * (p + v), lat)
    if source.shape != expected:
        raise LifecycleError(
            f"kv_b_proj.weight shape {source.shape} does not match the layer geometry: "
            f"expected {expected} = (num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)"
        )
    per_row = source.scratch_bytes_per_row()
    if per_row is None:  # external dequant: one chunk, no bound we can promise
        return AbsorptionPlan(n, p, v, lat, act_dtype, resolve_device(layer.kv_b_proj), n, None)
    per_head = (p + v) * per_row
    if per_head > config.max_scratch_bytes:
        raise LifecycleError(
            f"max_scratch_bytes={config.max_scratch_bytes} is below the {per_head} bytes one "
            f"head needs to dequantize ({source.fmt}, {p + v} rows x {lat})"
        )
    heads = n if per_head == 0 else min(n, config.max_scratch_bytes // per_head)
    return AbsorptionPlan(
        num_heads=n,
        nope_dim=p,
        v_dim=v,
        latent_dim=lat,
        dtype=act_dtype,
        device=resolve_device(layer.kv_b_proj),
        heads_per_chunk=heads,
        scratch_bound_bytes=heads * per_head,
    )


def _incompatibility(tensor: object, shape: tuple, plan: AbsorptionPlan) -> str | None:
    """Why ``tensor`` cannot be reused as pair storage, or None if it can."""
    if not isinstance(tensor, torch.Tensor):
        return "absent"
    if tuple(tensor.shape) != shape:
        return f"shape {tuple(tensor.shape)} != {shape}"
    if tensor.dtype != plan.dtype:
        return f"dtype {tensor.dtype} != {plan.dtype}"
    if tensor.device != plan.device:
        return f"device {tensor.device} != {plan.device}"
    if not tensor.is_contiguous():
        return f"strided {tuple(tensor.stride())}"
    return None


def preallocate(layer: nn.Module, plan: AbsorptionPlan) -> tuple[dict, dict[str, str]]:
    """Pair storage: existing compatible tensors reused, the rest allocated now."""
    pair, actions = {}, {}
    for name, shape in plan.shapes.items():
        existing = getattr(layer, name, None)
        reason = _incompatibility(existing, shape, plan)
        if reason is None:
            pair[name], actions[name] = existing, "reused"
            continue
        pair[name] = torch.empty(shape, dtype=plan.dtype, device=plan.device)
        actions[name] = "allocated" if reason == "absent" else f"replaced ({reason})"
        if reason != "absent":
            logger.info("vllm-mla: %s storage replaced: %s", name, reason)
    return pair, actions


def materialize(pair: dict, source: KVBSource, plan: AbsorptionPlan) -> None:
    """Dequantize one head group at a time straight into the pair (scratch <= the plan's bound)."""
    p, v, lat = plan.nope_dim, plan.v_dim, plan.latent_dim
    w_uk_t, w_uv = pair["W_UK_T"], pair["W_UV"]
    for h0, h1 in plan.chunks:
        rows = source.dequantize_rows(h0 * (p + v), h1 * (p + v)).view(h1 - h0, p + v, lat)
        # copy_ rounds to the pair dtype exactly as .to() would, without a second temporary.
        w_uk_t[h0:h1].copy_(rows[:, :p, :])
        w_uv[h0:h1].copy_(rows[:, p:, :].transpose(1, 2))
        del rows


def _bind(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
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


def state_of(layer: nn.Module) -> AbsorbedState:
    """The lifecycle state kept on ``layer`` (created empty on first use)."""
    state = layer.__dict__.get(STATE_ATTR)
    if state is None:
        state = AbsorbedState()
        layer.__dict__[STATE_ATTR] = state
    return state


def post_load(
    layer: nn.Module,
    act_dtype: torch.dtype = torch.bfloat16,
    config: LifecycleConfig | None = None,
    *,
    reader: Callable[[nn.Module], KVBSource | None] = sources.read_source,
    refresh: bool = False,
) -> PostLoadReport:
    """Run the lean lifecycle on ``layer``; see the module docstring for the guarantees.

    ``reader`` turns ``layer.kv_b_proj`` into a source (None when released); the vLLM
    integration passes one that knows vLLM's quant methods. ``refresh`` re-materializes
    whenever a source is present, for callers whose loaders write through ``.data``
    (invisible to the version counter the no-op check reads), as vLLM's reload does.
    """
    config = config or LifecycleConfig()
    config.check_release()
    state = state_of(layer)
    source = reader(layer.kv_b_proj)
    if source is None:
        if state.fingerprint is not None and state.released:
            return PostLoadReport("noop")
        raise LifecycleError(
            "kv_b_proj holds no source tensors and this layer has no materialized absorbed "
            "pair: the weights must be loaded before post-load"
        )
    if not refresh and state.fingerprint == source.fingerprint():
        return PostLoadReport("noop")
    if aliases_source(source, act_dtype, config):
        for name, view in upstream_views(layer, source.weight).items():
            _replace_parameter(layer, name, view)
        state.fingerprint, state.released = source.fingerprint(), False
        return PostLoadReport("aliased")

    plan = plan_absorption(layer, source, act_dtype, config)
    action = "reloaded" if state.fingerprint is not None else "materialized"
    pair, actions = preallocate(layer, plan)
    try:
        materialize(pair, source, plan)
    except BaseException as exc:
        exc.add_note(
            "vllm-mla: absorbed-pair materialization failed; kv_b_proj's source is intact "
            "and nothing was released; post-load can be retried"
        )
        raise
    for name in PAIR:
        _bind(layer, name, pair[name])

    released = 0
    if config.release_source:
        released = sources.release(source, layer.kv_b_proj)
    state.released = config.release_source
    del source
    after = reader(layer.kv_b_proj)
    state.fingerprint = after.fingerprint() if after is not None else ("released",)
    return PostLoadReport(action, actions, released, plan)


def baseline_post_load(layer: nn.Module, act_dtype: torch.dtype = torch.bfloat16) -> None:
    """What vLLM 0.33 does: dequantize the whole layer, keep the source, pair as views.

    Quantized sources go through whole-layer fp32 temporaries before the cast
    (block FP8 as upstream; upstream's MXFP8 path multiplies by an identity matrix,
    modelled here the same way as block FP8). The pair is bound
    with ``replace_parameter`` semantics: copied in place when shape, stride, dtype
    and device all match, otherwise rebound.
    """
    source = sources.read_source(layer.kv_b_proj)
    if source is None:
        raise LifecycleError("baseline post-load needs kv_b_proj's source tensors")
    weight = _upstream_dequantize(source).to(act_dtype)
    for name, view in upstream_views(layer, weight).items():
        _replace_parameter(layer, name, view)


def aliases_source(source: KVBSource, act_dtype: torch.dtype, config: LifecycleConfig) -> bool:
    """True when the pair is best left as views of the source: a dense kv_b_proj already
    in ``act_dtype`` that must stay. A copy would add the pair's bytes and save nothing."""
    return source.fmt == "dense" and source.weight.dtype == act_dtype and not config.release_source


def upstream_views(layer: nn.Module, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's pair as views of ``weight [N*(P+V), L]``: W_UK_T [N, P, L], W_UV [N, L, V]."""
    n, p, v, lat = layer_dims(layer)
    w_uk, w_uv = weight.T.view(lat, n, p + v).split([p, v], dim=-1)
    return {"W_UV": w_uv.transpose(0, 1), "W_UK_T": w_uk.permute(1, 2, 0)}


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _upstream_dequantize(source: KVBSource) -> torch.Tensor:
    """The whole layer at once, as vLLM 0.33 does: widen to fp32, expand the scales to
    the element grid, multiply. Same fp32 products as ``dequantize_rows`` (so the values
    are bit-identical), with upstream's whole-layer fp32 temporaries."""
    weight = source.weight
    if source.fmt == "dense":
        return weight
    if source.fmt == "external":
        return source.dequantize_rows(0, source.shape[0])
    rows, cols = source.shape
    scale = source.tensors[1]
    if source.fmt == "fp8-block":
        scale = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        scale = scale[:rows, :cols]
    else:
        codes = scale.view(torch.uint8)
        scale = mxfp8.decode_scales(codes).repeat_interleave(mxfp8.BLOCK_SIZE, 1)
    return weight.to(torch.float32) * scale


def _replace_parameter(layer: nn.Module, name: str, new: torch.Tensor) -> None:
    old = getattr(layer, name, None)
    if isinstance(old, torch.Tensor) and _same_view(old, new):
        return  # already this very view: copying it onto itself would only cost time
    if (
        isinstance(old, torch.Tensor)
        and old.shape == new.shape
        and old.stride() == new.stride()
        and old.dtype == new.dtype
        and old.device == new.device
    ):
        old.copy_(new)
        return
    _bind(layer, name, nn.Parameter(new, requires_grad=False))
