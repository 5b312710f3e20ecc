"""`vllm-mla qualify`: baseline vs lean on one TP rank, measured by the same ledger.

Builds every layer's kv_b_proj (synthetic seeded weights or a checkpoint), runs
upstream's post-load (baseline) and the lean lifecycle side by side, and checks:
bit-identical absorbed pairs, stable pair addresses across a reload with new
weights, and correct regeneration after the source was released.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from vllm_mla.geometry import MLAGeometry, RankGeometry, from_hf_config, preset
from vllm_mla.memory import AllocationTrace, Ledger
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.weights import LifecycleConfig, baseline_post_load, post_load
from vllm_mla.weights.absorb import ABSORBED_MODES, DEFAULT_MAX_SCRATCH_BYTES, PAIR
from vllm_mla.weights.checkpoint import checkpoint_format, load_kv_b_proj
from vllm_mla.weights.direct import DIRECT_DECODES
from vllm_mla.weights.forms import FORM_NAMES, FORMS, KVBForm, form
from vllm_mla.weights.standins import (
    FormTensors,
    MLALayer,
    build_kv_b_proj,
    build_layer,
    checkpoint_family,
    checkpoint_tensors,
    form_tensors,
    synthetic_weight,
)

SCHEMA = 1
ACT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
MHA_PREFILL_NOTE = "source kept: a dense MHA prefill backend calls kv_b_proj (--mha-prefill)"
NO_RELEASE_NOTE = "source kept: release disabled (--no-release)"
ALIAS_NOTE = (
    "pair aliases the dense source, as upstream's does: nothing to reclaim while it is kept"
)

Progress = Callable[[str, int], Iterator[int]]
# The form modelled when --weights is not given: what vLLM 0.33 selects by default for
# each checkpoint family on the GPUs these models are served on (GLM-5 MXFP8 on SM120/SM100:
# FlashInfer CUTLASS; block FP8 on H100/H200: DeepGEMM).
DEFAULT_FORM = {"mxfp8": "mxfp8-flashinfer", "fp8-block": "fp8-block-deepgemm"}


def plain_progress(label: str, total: int) -> Iterator[int]:
    return iter(range(total))


@dataclass(frozen=True)
class QualifyConfig:
    """Everything one qualify run depends on."""

    preset: str = "glm-5"
    model: str | None = None  # a model folder: geometry from its config.json, weights from it
    dtype: str = "bfloat16"  # the activation dtype vLLM serves in
    tp: int = 4
    rank: int = 0
    weights: str | None = None  # a kv_b_proj form; None: DEFAULT_FORM of the checkpoint family
    layers: int | None = None
    device: str = "auto"
    checkpoint: str | None = None
    release: bool = True
    mha_prefill: bool = False
    seed: int = 0
    max_scratch_bytes: int = DEFAULT_MAX_SCRATCH_BYTES
    absorbed: str = "bf16"  # bf16 pair, or direct: MXFP8 views of the pack


class QualifyError(ValueError):
    """A setting qualify cannot run with; the message names it."""


def device_named(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise QualifyError("--device cuda: no CUDA device is available to this torch build")
    if name not in ("cpu", "cuda"):
        raise QualifyError(f"--device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def _form_for(cfg: QualifyConfig, family: str) -> KVBForm:
    name = cfg.weights or DEFAULT_FORM.get(family, family)
    if name not in FORM_NAMES:
        raise QualifyError(f"--weights must be one of {', '.join(FORM_NAMES)}, got {name!r}")
    f = form(name)
    dense = {"bf16", "fp16", "fp32"}
    if checkpoint_family(f) != family and not (family in dense and f.family == "unquantized"):
        raise QualifyError(
            f"--weights {name} is loaded from a {checkpoint_family(f)} checkpoint, but the "
            f"checkpoint holds {family} kv_b_proj"
        )
    return f


def _sources(
    cfg: QualifyConfig, geo: RankGeometry, act: torch.dtype, progress: Progress
) -> tuple[KVBForm, list[FormTensors]]:
    """(form, per-layer CPU tensors in that form) from the checkpoint or the seed."""
    if cfg.checkpoint:
        per_layer = load_kv_b_proj(cfg.checkpoint, geo, cfg.layers)
        f = _form_for(cfg, checkpoint_format(per_layer[0]))
        return f, [form_tensors(t, f.name, act) for t in per_layer]
    f = _form_for(cfg, checkpoint_family(form(cfg.weights or DEFAULT_FORM["mxfp8"])))
    count = geo.model.num_layers if cfg.layers is None else cfg.layers
    per_layer = [synthetic_tensors(geo, f, cfg.seed, i, act) for i in progress("weights", count)]
    return f, per_layer


def synthetic_tensors(
    geo: RankGeometry, f: KVBForm, seed: int, layer: int, act: torch.dtype
) -> FormTensors:
    """Layer ``layer``'s seeded weights as ``f`` holds them (loaded from its checkpoint family)."""
    weight = synthetic_weight(geo, seed=seed, layer=layer)
    return form_tensors(checkpoint_tensors(weight, checkpoint_family(f)), f.name, act)


def load_into(layer: MLALayer, held: FormTensors, device: torch.device) -> None:
    """Give ``layer`` new kv_b_proj weights the way vLLM's reload re-creates them: new
    parameters, a regenerated packed owner, the kernel's new state."""
    fresh = build_kv_b_proj(held, device)
    kv_b = layer.kv_b_proj
    for name, param in fresh._parameters.items():
        kv_b._parameters[name] = param
    for name in held.packed:
        setattr(kv_b, name, getattr(fresh, name))
    kv_b.quant_method = fresh.quant_method


def _drop_cached_blocks(device: torch.device) -> None:
    """Start a phase from an empty CUDA cache, so its holes are its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _reserved_unallocated(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _phase(
    layers: list[MLALayer],
    run: Callable[[MLALayer], object],
    device,
    progress,
    label,
    timelines: dict | None = None,
) -> dict:
    """Post-load every layer under one allocation trace; the owners' bytes after it."""
    with AllocationTrace(device) as trace:
        for i in progress(label, len(layers)):
            run(layers[i])
    if timelines is not None:
        timelines[label] = trace.timeline()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    ledger = ledger_of(layers)
    return {
        "absorbed_bytes": ledger.bytes_of("absorbed"),
        "source_bytes": ledger.bytes_of("source"),
        "packed_bytes": ledger.bytes_of("packed"),
        "resident_bytes": ledger.resident_bytes,
        "peak_transient_bytes": trace.transient_peak(),
        "reserved_unallocated_bytes": _reserved_unallocated(device),
    }


def ledger_of(layers: list[MLALayer]) -> Ledger:
    """One ledger over ``layers`` (a storage shared by two layers counts once)."""
    ledger = Ledger()
    for layer in layers:
        ledger.add_layer(layer)
    return ledger


def upstream_pair(
    geo: RankGeometry, held: FormTensors, device: torch.device, act: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The pair upstream's post-load makes from ``held`` on a layer built for it alone."""
    reference = build_layer(geo, held, device)
    baseline_post_load(reference, act)
    return dense_pair(reference)


def act_dtype(name: str) -> torch.dtype:
    """The activation dtype ``name`` (``--dtype``); QualifyError for another name."""
    if name not in ACT_DTYPES:
        raise QualifyError(f"--dtype must be one of {', '.join(ACT_DTYPES)}, got {name!r}")
    return ACT_DTYPES[name]


def check_absorbed(absorbed: str, f: KVBForm) -> None:
    """QualifyError unless ``absorbed`` (``--absorbed``) is a mode that can serve ``f``."""
    if absorbed not in ABSORBED_MODES:
        raise QualifyError(
            f"--absorbed must be one of {', '.join(ABSORBED_MODES)}, got {absorbed!r}"
        )
    if absorbed == "direct" and f.decode not in DIRECT_DECODES:
        raise QualifyError(
            f"--absorbed direct serves an MXFP8 pack ({', '.join(direct_forms())}); "
            f"--weights {f.name} is not one"
        )


def _max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def dense_pair(layer: MLALayer) -> tuple[torch.Tensor, ...]:
    """The pair's values as plain tensors (direct mode: decoded from the views)."""
    return tuple(_dense(getattr(layer, n)) for n in PAIR)


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.dense_values() if isinstance(t, AbsorbedWeight) else t


def pair_pointers(layer: MLALayer) -> list[int]:
    """Addresses of what the pair holds (a routed weight: the tensors it wraps)."""
    held = []
    for name in PAIR:
        t = getattr(layer, name)
        held += t.inner_tensors() if isinstance(t, AbsorbedWeight) else [t]
    return [t.data_ptr() for t in held]


def _reload_check(lean: list[MLALayer], geo, f, cfg, lifecycle, act, device, progress) -> dict:
    """Give every lean layer new weights the way a reload does; pointers must not move."""
    stable = correct = True
    for i in progress("reload", len(lean)):
        layer = lean[i]
        before = pair_pointers(layer)
        new = synthetic_tensors(geo, f, cfg.seed + 1, i, act)
        load_into(layer, new, device)
        post_load(layer, act, lifecycle)
        stable &= before == pair_pointers(layer)
        reference = upstream_pair(geo, new, device, act)
        correct &= all(torch.equal(a, b) for a, b in zip(dense_pair(layer), reference, strict=True))
    return {"stable": stable, "correct": correct}


def direct_forms() -> list[str]:
    """The ``--weights`` forms ``--absorbed direct`` serves."""
    return [f.name for f in FORMS if f.decode in DIRECT_DECODES]


def model_geometry(cfg: QualifyConfig) -> MLAGeometry:
    """The preset, or the geometry of ``cfg.model``'s config.json."""
    return from_hf_config(cfg.model) if cfg.model else preset(cfg.preset)


def run_qualify(
    cfg: QualifyConfig, progress: Progress = plain_progress, timelines: dict | None = None
) -> dict:
    """Run baseline and lean side by side; returns the ``--json`` report (schema 1).
    ``timelines``, when given, receives each phase's ``AllocationTrace.timeline()`` under
    "baseline" and "lean"; the report is the same either way."""
    started = time.perf_counter()
    geo = model_geometry(cfg).shard(cfg.tp, cfg.rank)
    device = device_named(cfg.device)
    act = act_dtype(cfg.dtype)
    if cfg.model and not cfg.checkpoint:
        cfg = replace(cfg, checkpoint=cfg.model)
    if cfg.layers is not None and cfg.layers <= 0:
        raise QualifyError(f"--layers must be positive, got {cfg.layers}")
    f, per_layer = _sources(cfg, geo, act, progress)
    check_absorbed(cfg.absorbed, f)
    lifecycle = LifecycleConfig(
        release_source=cfg.release and not cfg.mha_prefill,
        dense_mha_prefill=cfg.mha_prefill,
        max_scratch_bytes=cfg.max_scratch_bytes,
        absorbed=cfg.absorbed,
    )

    _drop_cached_blocks(device)
    base_layers = [build_layer(geo, t, device) for t in per_layer]
    baseline = _phase(
        base_layers,
        lambda lay: baseline_post_load(lay, act),
        device,
        progress,
        "baseline",
        timelines,
    )
    reference = [tuple(t.cpu() for t in dense_pair(layer)) for layer in base_layers]
    del base_layers
    _drop_cached_blocks(device)
    lean_layers = [build_layer(geo, t, device) for t in per_layer]
    reports = []
    lean = _phase(
        lean_layers,
        lambda lay: reports.append(post_load(lay, act, lifecycle)),
        device,
        progress,
        "lean",
        timelines,
    )
    parity, bit_identical = 0.0, True
    for layer, ref in zip(lean_layers, reference, strict=True):
        for ours, theirs in zip(dense_pair(layer), ref, strict=True):
            ours = ours.cpu()
            parity = max(parity, _max_abs_err(ours, theirs))
            bit_identical &= torch.equal(ours, theirs)
    idempotent = all(post_load(lay, act, lifecycle).action == "noop" for lay in lean_layers)
    del reference
    released = lifecycle.release_source and lean["source_bytes"] == 0
    reload = _reload_check(lean_layers, geo, f, cfg, lifecycle, act, device, progress)

    notes = []
    if cfg.mha_prefill:
        notes.append(MHA_PREFILL_NOTE)
    elif not cfg.release:
        notes.append(NO_RELEASE_NOTE)
    plan = reports[0].plan
    if reports[0].action == "aliased":
        notes.append(ALIAS_NOTE)
    return {
        "schema": SCHEMA,
        "preset": geo.model.name,
        "dtype": cfg.dtype,
        "tp": cfg.tp,
        "rank": cfg.rank,
        "heads_per_rank": geo.num_heads,
        "real_heads": geo.real_heads,
        "layers": len(per_layer),
        "weights": f.name,
        "absorbed": cfg.absorbed,
        "form": {
            "name": f.name,
            "family": f.family,
            "vllm": f.selected,
            "left_on_kv_b_proj": f.tensors,
            "decode": f.decode,
            "upstream": f.upstream,
            "scratch_bounded": f.bounded,
        },
        "device": str(device),
        "source": cfg.checkpoint or f"synthetic(seed={cfg.seed})",
        "baseline": baseline,
        "lean": lean,
        "reclaimed_bytes": baseline["resident_bytes"] - lean["resident_bytes"],
        "scratch_bound_bytes": plan.scratch_bound_bytes if plan else 0,
        "heads_per_chunk": plan.heads_per_chunk if plan else 0,
        "chunk_axis": plan.axis if plan else None,
        "per_chunk": plan.per_chunk if plan else 0,
        "checks": {
            "parity_max_abs_err": parity,
            "parity_ok": bit_identical and parity == 0.0,
            "source_released": released,
            "reload_pointers_stable": reload["stable"],
            "reload_values_correct": reload["correct"],
            "regenerated_after_release": released and reload["correct"],
            "postload_idempotent": idempotent,
        },
        "release_requested": lifecycle.release_source,
        "notes": notes,
        "elapsed_s": round(time.perf_counter() - started, 3),
    }


def failed_checks(report: dict) -> list[str]:
    """Names of the checks that apply to this run and did not pass."""
    checks = report["checks"]
    names = ["parity_ok", "reload_pointers_stable", "reload_values_correct", "postload_idempotent"]
    if report["release_requested"]:
        names += ["source_released", "regenerated_after_release"]
    return [n for n in names if not checks[n]]
