"""`vllm-mla qualify`: baseline vs lean on one TP rank, measured by the same ledger.

Builds every layer's kv_b_proj (synthetic seeded weights or a checkpoint), runs
upstream's post-load (baseline) and the lean lifecycle side by side, and checks:
bit-identical absorbed pairs, stable pair addresses across a reload with new
weights, and correct regeneration after the source was released.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from vllm_mla.geometry import MLAGeometry, RankGeometry, from_hf_config, preset
from vllm_mla.kv_capacity import capacity
from vllm_mla.memory import AllocationTrace
from vllm_mla.tools.checkpoint import checkpoint_format, load_kv_b_proj
from vllm_mla.tools.harness import (
    Progress,
    QualifyError,
    act_dtype,
    check_absorbed,
    dense_pair,
    device_named,
    ledger_of,
    load_into,
    max_abs_err,
    pair_pointers,
    plain_progress,
    synthetic_tensors,
    upstream_pair,
)
from vllm_mla.tools.standins import (
    FormTensors,
    MLALayer,
    build_layer,
    checkpoint_family,
    form_tensors,
)
from vllm_mla.weights import LifecycleConfig, baseline_post_load, post_load
from vllm_mla.weights.absorb import DEFAULT_MAX_SCRATCH_BYTES
from vllm_mla.weights.forms import FORM_NAMES, KVBForm, form

SCHEMA = 1
MHA_PREFILL_NOTE = "source kept: a dense MHA prefill backend calls kv_b_proj (--mha-prefill)"
NO_RELEASE_NOTE = "source kept: release disabled (--no-release)"
ALIAS_NOTE = (
    "pair aliases the dense source, as upstream's does: nothing to reclaim while it is kept"
)

# The form modelled when --weights is not given: what vLLM 0.33 selects by default for
# each checkpoint family on the GPUs these models are served on (GLM-5 MXFP8 on SM120/SM100:
# FlashInfer CUTLASS; block FP8 on H100/H200: DeepGEMM).
DEFAULT_FORM = {"mxfp8": "mxfp8-flashinfer", "fp8-block": "fp8-block-deepgemm"}


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


def model_geometry(cfg: QualifyConfig) -> MLAGeometry:
    """The preset, or the geometry of ``cfg.model``'s config.json."""
    return from_hf_config(cfg.model) if cfg.model else preset(cfg.preset)


def _parity(lean: list[MLALayer], reference: list[tuple]) -> tuple[float, bool]:
    """(max |ours - upstream's|, bit-identical) over every layer's pair."""
    parity, bit_identical = 0.0, True
    for layer, ref in zip(lean, reference, strict=True):
        for ours, theirs in zip(dense_pair(layer), ref, strict=True):
            ours = ours.cpu()
            parity = max(parity, max_abs_err(ours, theirs))
            bit_identical &= torch.equal(ours, theirs)
    return parity, bit_identical


def _padding(geo: RankGeometry, lean: list[MLALayer], act: torch.dtype) -> dict:
    """What head padding costs and whether it is inert: the model's heads and the padded
    total (TP sizes that do not divide them: ``geometry.MLAGeometry.shard``), this rank's
    padded heads, the absorbed pair bytes they take on this rank and on all ranks, and
    whether every padded head's pair is exactly zero (from zero kv_b_proj rows)."""
    m = geo.model
    per_head = (m.qk_nope_head_dim * m.kv_lora_rank + m.kv_lora_rank * m.v_head_dim) * (
        torch.empty((), dtype=act).element_size()
    )
    total = geo.num_heads * geo.tp
    zero = all(bool((t[geo.real_heads :] == 0).all()) for layer in lean for t in dense_pair(layer))
    return {
        "heads": m.num_heads,
        "padded_heads_total": total,
        "padded_heads_on_rank": geo.padded_heads,
        "pair_bytes_on_rank": geo.padded_heads * per_head * len(lean),
        "pair_bytes_all_ranks": (total - m.num_heads) * per_head * len(lean),
        "padded_heads_zero": zero,
    }


def _notes(cfg: QualifyConfig, action: str) -> list[str]:
    notes = []
    if cfg.mha_prefill:
        notes.append(MHA_PREFILL_NOTE)
    elif not cfg.release:
        notes.append(NO_RELEASE_NOTE)
    if action == "aliased":
        notes.append(ALIAS_NOTE)
    return notes


def _form_record(f: KVBForm) -> dict:
    return {
        "name": f.name,
        "family": f.family,
        "vllm": f.selected,
        "left_on_kv_b_proj": f.tensors,
        "decode": f.decode,
        "upstream": f.upstream,
        "scratch_bounded": f.bounded,
    }


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
    parity, bit_identical = _parity(lean_layers, reference)
    padding = _padding(geo, lean_layers, act)
    idempotent = all(post_load(lay, act, lifecycle).action == "noop" for lay in lean_layers)
    del reference
    released = lifecycle.release_source and lean["source_bytes"] == 0
    reload = _reload_check(lean_layers, geo, f, cfg, lifecycle, act, device, progress)

    plan = reports[0].plan
    return {
        "schema": SCHEMA,
        "preset": geo.model.name,
        "dtype": cfg.dtype,
        "tp": cfg.tp,
        "rank": cfg.rank,
        "heads_per_rank": geo.num_heads,
        "real_heads": geo.real_heads,
        "padding": padding,
        "layers": len(per_layer),
        "weights": f.name,
        "absorbed": cfg.absorbed,
        "form": _form_record(f),
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
            "padded_heads_zero": padding["padded_heads_zero"],
        },
        "release_requested": lifecycle.release_source,
        # what one token of context costs in KV cache on this rank, per record format
        # (DCP 1, no indexer; ``vllm-mla kv-capacity`` for a pool at a budget)
        "kv_records": [
            {
                "format": r.kv_format,
                "bytes_per_token_layer": r.record_bytes,
                "bytes_per_token": int(r.bytes_per_token_rank),
            }
            for r in capacity(len(per_layer), 1.0, dcp=1, index_bytes=0)
        ],
        "notes": _notes(cfg, reports[0].action),
        "elapsed_s": round(time.perf_counter() - started, 3),
    }


def failed_checks(report: dict) -> list[str]:
    """Names of the checks that apply to this run and did not pass."""
    checks = report["checks"]
    names = ["parity_ok", "reload_pointers_stable", "reload_values_correct", "postload_idempotent"]
    names += ["padded_heads_zero"]
    if report["release_requested"]:
        names += ["source_released", "regenerated_after_release"]
    return [n for n in names if not checks[n]]
