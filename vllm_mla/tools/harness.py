"""What qualify and soak share: the stand-in layers' weights, their pair, the ledger, the
settings both accept, and one error type that names the setting at fault."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from vllm_mla.geometry import RankGeometry
from vllm_mla.memory import Ledger
from vllm_mla.ops.absorbed_weight import AbsorbedWeight
from vllm_mla.tools.standins import (
    FormTensors,
    MLALayer,
    build_kv_b_proj,
    build_layer,
    checkpoint_family,
    checkpoint_tensors,
    form_tensors,
    synthetic_weight,
)
from vllm_mla.weights import baseline_post_load
from vllm_mla.weights.absorb import ABSORBED_MODES, PAIR
from vllm_mla.weights.direct import DIRECT_DECODES
from vllm_mla.weights.forms import FORMS, KVBForm

ACT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


Progress = Callable[[str, int], Iterator[int]]


def plain_progress(label: str, total: int) -> Iterator[int]:
    return iter(range(total))


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


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
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


def direct_forms() -> list[str]:
    """The ``--weights`` forms ``--absorbed direct`` serves."""
    return [f.name for f in FORMS if f.decode in DIRECT_DECODES]
