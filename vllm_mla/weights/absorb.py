"""The absorbed-weight lifecycle: plan -> preallocate -> materialize -> release -> reload.

``post_load(layer, act_dtype, config)`` turns ``layer.kv_b_proj`` into the
contiguous absorbed pair ``layer.W_UK_T [N, P, L]`` and ``layer.W_UV [N, L, V]``:

1. plan the pair and a bounded scratch (head groups, or latent columns for layouts
   read through the layer's own GEMM);
2. preallocate the pair before any scratch exists (on reload, compatible storage
   is kept so CUDA-graph addresses never move, and the new values are staged beside it);
3. dequantize chunk by chunk straight into the new (or staged) pair;
4. prepare the release (when the config allows it), then commit: copy a staged pair
   into the live one, bind a new one, swap the source for placeholders.

A failure before the commit leaves every tensor of the layer as it was (identity and
values) and the next post-load retries from scratch; the commit itself is plain
assignments and two same-shape copies. Running it again with nothing new is a no-op.
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

from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.quant import mxfp8
from vllm_mla.weights import faults, forms
from vllm_mla.weights.sources import ChunkAxis, KVBSource, prepare_release

logger = logging.getLogger("vllm_mla")

FP8_BLOCK = 128  # DeepSeek block-FP8 scale granularity (rows and columns)
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
    reader = source.reader
    per_unit = (p + v) * reader.unit_bytes if reader.axis == "rows" else reader.unit_bytes
    what = f"one head ({p + v} rows x {lat})" if reader.axis == "rows" else "one latent column"
    if per_unit > config.max_scratch_bytes:
        raise LifecycleError(
            f"max_scratch_bytes={config.max_scratch_bytes} is below the {per_unit} bytes "
            f"{what} needs to dequantize ({source.form})"
        )
    total = n if reader.axis == "rows" else lat
    per_chunk = total if per_unit == 0 else min(total, config.max_scratch_bytes // per_unit)
    return AbsorptionPlan(
        num_heads=n,
        nope_dim=p,
        v_dim=v,
        latent_dim=lat,
        dtype=act_dtype,
        device=source.device,
        axis=reader.axis,
        per_chunk=per_chunk,
        scratch_bound_bytes=per_chunk * per_unit,
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


def preallocate(layer: nn.Module, plan: AbsorptionPlan) -> tuple[dict, dict, dict[str, str]]:
    """(live, targets, actions): pair storage, existing compatible tensors kept.

    ``live[name]`` is what the layer will hold; ``targets[name]`` is where the new values
    are written: the new tensor itself, or a staging tensor beside a kept one (so a
    failure never leaves a live pair half refilled).
    """
    live, targets, actions = {}, {}, {}
    for name, shape in plan.shapes.items():
        existing = getattr(layer, name, None)
        reason = _incompatibility(existing, shape, plan)
        faults.site("alloc", name)
        fresh = torch.empty(shape, dtype=plan.dtype, device=plan.device)
        if reason is None:
            live[name], targets[name], actions[name] = existing, fresh, "reused"
            continue
        live[name] = targets[name] = fresh
        actions[name] = "allocated" if reason == "absent" else f"replaced ({reason})"
        if reason != "absent":
            logger.info("vllm-mla: %s storage replaced: %s", name, reason)
    return live, targets, actions


def materialize(pair: dict, source: KVBSource, plan: AbsorptionPlan) -> None:
    """Dequantize one chunk at a time straight into ``pair`` (scratch <= the plan's bound)."""
    n, p, v, lat = plan.num_heads, plan.nope_dim, plan.v_dim, plan.latent_dim
    w_uk_t, w_uv = pair["W_UK_T"], pair["W_UV"]
    for a, b in plan.chunks:
        faults.site("dequant", f"{plan.axis} {a}:{b}")
        if plan.axis == "rows":
            rows = source.reader.read(a * (p + v), b * (p + v)).view(b - a, p + v, lat)
            faults.site("copy", f"heads {a}:{b}")
            # copy_ rounds to the pair dtype exactly as .to() would, without a temporary.
            w_uk_t[a:b].copy_(rows[:, :p, :])
            w_uv[a:b].copy_(rows[:, p:, :].transpose(1, 2))
            del rows
        else:
            cols = source.reader.read(a, b).view(b - a, n, p + v)  # W[:, a:b].T
            faults.site("copy", f"latent {a}:{b}")
            w_uk_t[:, :, a:b].copy_(cols[:, :, :p].permute(1, 2, 0))
            w_uv[:, a:b, :].copy_(cols[:, :, p:].transpose(0, 1))
            del cols


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


def _unwrap_pair(layer: nn.Module) -> None:
    """Put a routed (dense ``AbsorbedWeight``) pair back as plain Parameters, same storage.

    The route is re-bound after post-load by its owner; the storage (and so every
    CUDA-graph address) is the one the lifecycle refills in place.
    """
    for name in (*PAIR, "W_UK_T_dcp_qrep"):
        current = layer._parameters.get(name)
        if isinstance(current, AbsorbedWeight):
            if current.kind != "dense":
                raise LifecycleError(
                    f"{name} holds MXFP8 views (direct mode); a bf16 post-load cannot take "
                    "them over in the same process (keep VLLM_MLA_ABSORBED unchanged)"
                )
            layer._parameters[name] = nn.Parameter(current.dense_values(), requires_grad=False)


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


def post_load(
    layer: nn.Module,
    act_dtype: torch.dtype = torch.bfloat16,
    config: LifecycleConfig | None = None,
    *,
    reader: Callable[[nn.Module], KVBSource | None] | None = None,
    refresh: bool = False,
) -> PostLoadReport:
    """Run the lean lifecycle on ``layer``; see the module docstring for the guarantees.

    ``reader`` turns ``layer.kv_b_proj`` into a source (None when released); the default
    detects its form from the kv_b_proj matrix. ``refresh`` re-materializes whenever a
    source is present, for callers whose loaders write through ``.data`` (invisible to
    the version counter the no-op check reads), as vLLM's reload does.
    """
    config = config or LifecycleConfig()
    config.check_release()
    if config.absorbed == "direct":
        from vllm_mla.weights import direct

        release = config.release_source and not config.dense_mha_prefill
        return PostLoadReport(direct.post_load_direct(layer, act_dtype, release, refresh=refresh))
    _unwrap_pair(layer)
    state = state_of(layer)
    source = (reader or default_reader(act_dtype))(layer.kv_b_proj)
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
        for name, view in upstream_views(layer, source.dense).items():
            _replace_parameter(layer, name, view)
        state.fingerprint, state.released = source.fingerprint(), False
        return PostLoadReport("aliased")

    plan = plan_absorption(layer, source, act_dtype, config)
    action = "reloaded" if state.fingerprint is not None else "materialized"
    faults.begin()
    try:
        live, targets, actions = preallocate(layer, plan)
        materialize(targets, source, plan)
        release = prepare_release(source) if config.release_source else None
        # Everything that can fail has run; the sites of the commit copies come first
        # so that an injected fault there, too, finds the live pair untouched.
        staged = [name for name in PAIR if targets[name] is not live[name]]
        for name in staged:
            faults.site("copy", f"commit {name}")
    except Exception as exc:
        raise PostLoadError.after(MATERIALIZE, SOURCE_KEPT, exc) from exc
    with torch.no_grad():
        for name in staged:
            live[name].copy_(targets[name])
    del targets
    for name in PAIR:
        _bind(layer, name, live[name])
    released = release.commit() if release is not None else 0
    state.released = config.release_source
    state.fingerprint = source.fingerprint() if release is None else ("released",)
    return PostLoadReport(action, actions, released, plan)


def baseline_post_load(layer: nn.Module, act_dtype: torch.dtype = torch.bfloat16) -> None:
    """What vLLM 0.33's MLA post-load does for kv_b_proj's form (``KVBForm.upstream``).

    ``cast``: ``weight.to(act_dtype)`` (the pair aliases a weight already in that dtype).
    ``scaled-dequantize``: the whole layer through float32 temporaries, then cast.
    ``apply-eye``: a ``[K, K]`` identity in the activation dtype (quantized first by a W8A8
    kernel: e4m3 values and scales) through the layer's GEMM into a ``[K, N]`` output that
    the pair keeps as views. The GEMM itself is modelled: exact values written one head at
    a time (<= one head of float32 decode scratch, a modelling artefact; upstream's output
    is the exact dequantization for every kernel of the matrix). The source is kept.
    """
    source = default_reader(act_dtype)(layer.kv_b_proj)
    if source is None:
        raise LifecycleError("baseline post-load needs kv_b_proj's source tensors")
    f = forms.form(source.form)
    if f.upstream == "cast":
        weight = source.dense.to(act_dtype)
    elif f.upstream == "scaled-dequantize":
        weight = _scaled_dequantize(source).to(act_dtype)
    else:
        weight = _apply_identity(layer, source, f, act_dtype).T
    for name, view in upstream_views(layer, weight).items():
        _replace_parameter(layer, name, view)


def aliases_source(source: KVBSource, act_dtype: torch.dtype, config: LifecycleConfig) -> bool:
    """True when the pair is best left as views of the source: a dense kv_b_proj already
    in ``act_dtype`` that must stay. A copy would add the pair's bytes and save nothing."""
    return (
        source.dense is not None
        and forms.form(source.form).family == "unquantized"
        and source.dense.dtype == act_dtype
        and not config.release_source
    )


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


def _scaled_dequantize(source: KVBSource) -> torch.Tensor:
    """Block FP8 as vLLM's ``scaled_dequantize``: widen the values and the broadcast
    scales to float32 ``[N, K]`` and multiply, whole layer at once. Same float32 products
    as the chunked readers, so the values are bit-identical."""
    weight, scale = (source.module._parameters[n] for n in ("weight", "weight_scale_inv"))
    rows, cols = source.shape
    grid = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.to(torch.float32) * grid[:rows, :cols]


# Element bytes of the activation scales a W8A8 kernel makes for the identity, per
# element of the identity: block FP8 one fp32 per 128, MXFP8 one E8M0 byte per 32.
_ACT_SCALE_BYTES = {"fp8-block": 4 / 128, "mxfp8": 1 / mxfp8.BLOCK_SIZE}


def _apply_identity(
    layer: nn.Module, source: KVBSource, f: forms.KVBForm, act_dtype: torch.dtype
) -> torch.Tensor:
    """Upstream's ``quant_method.apply(layer, eye)`` -> ``[K, N]`` in ``act_dtype``."""
    rows, cols = source.shape
    quantized = None
    if f.w8a8:  # the kernel quantizes the identity before its GEMM
        scale_bytes = int(cols * cols * _ACT_SCALE_BYTES[f.family])
        quantized = (
            torch.empty(cols, cols, dtype=torch.float8_e4m3fn, device=source.device),
            torch.empty(scale_bytes, dtype=torch.uint8, device=source.device),
        )
    if source.reader.axis == "cols":  # the layer's own GEMM reads its layout
        return source.reader.read(0, cols)
    eye = torch.eye(cols, dtype=act_dtype, device=source.device)
    out = torch.empty(cols, rows, dtype=act_dtype, device=eye.device)
    step = layer.qk_nope_head_dim + layer.v_head_dim
    for r in range(0, rows, step):
        out[:, r : r + step].copy_(source.reader.read(r, min(r + step, rows)).T)
    del eye, quantized
    return out


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
