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
The BF16 mode; ``direct`` serves ``absorbed="direct"``, ``upstream`` models vLLM 0.33.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.weights import direct, faults
from vllm_mla.weights.lifecycle import (  # noqa: F401 (re-exported: the lifecycle's names)
    ABSORBED_MODES,
    DEFAULT_MAX_SCRATCH_BYTES,
    MATERIALIZE,
    PAIR,
    SOURCE_KEPT,
    AbsorptionPlan,
    LifecycleConfig,
    LifecycleError,
    PostLoadError,
    PostLoadReport,
    ReleaseRefusedError,
    bind_parameter,
    default_reader,
    layer_dims,
    state_of,
)
from vllm_mla.weights.sources import KVBSource, prepare_release
from vllm_mla.weights.upstream import (  # noqa: F401
    _replace_parameter,
    aliases_source,
    baseline_post_load,
    upstream_views,
)

logger = logging.getLogger("vllm_mla")


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
        release = config.release_source and not config.dense_mha_prefill
        return PostLoadReport(direct.post_load_direct(layer, act_dtype, release, refresh=refresh))
    _unwrap_pair(layer)
    state = state_of(layer)
    source = (reader or default_reader(act_dtype))(layer.kv_b_proj)
    done = _without_materializing(layer, state, source, act_dtype, config, refresh)
    if done is not None:
        return done
    plan = plan_absorption(layer, source, act_dtype, config)
    action = "reloaded" if state.fingerprint is not None else "materialized"
    actions, released = _materialize(layer, state, source, plan, config)
    return PostLoadReport(action, actions, released, plan)


def _without_materializing(layer, state, source, act_dtype, config, refresh):
    """The report of a call that builds nothing (no-op, upstream's aliasing), else None."""
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
    return None


def _materialize(layer, state, source, plan, config) -> tuple[dict, int]:
    """Preallocate -> fill -> commit -> release; (per-tensor actions, bytes released).
    A failure before the commit leaves the live pair and the source untouched."""
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
        bind_parameter(layer, name, live[name])
    released = release.commit() if release is not None else 0
    state.released = config.release_source
    state.fingerprint = source.fingerprint() if release is None else ("released",)
    return actions, released
