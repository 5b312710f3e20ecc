"""The absorbed-weight lifecycle (plan -> preallocate -> materialize -> release -> reload)."""

from vllm_mla.weights.absorb import (
    AbsorptionPlan,
    LifecycleConfig,
    LifecycleError,
    PostLoadError,
    PostLoadReport,
    ReleaseRefusedError,
    baseline_post_load,
    plan_absorption,
    post_load,
)
from vllm_mla.weights.device import DeviceResolutionError, resolve_device
from vllm_mla.weights.forms import FORMS, KVBForm, detect, read_source
from vllm_mla.weights.sources import KVBSource, SourceError

__all__ = [
    "FORMS",
    "AbsorptionPlan",
    "DeviceResolutionError",
    "KVBForm",
    "KVBSource",
    "LifecycleConfig",
    "LifecycleError",
    "PostLoadError",
    "PostLoadReport",
    "ReleaseRefusedError",
    "SourceError",
    "baseline_post_load",
    "detect",
    "plan_absorption",
    "post_load",
    "read_source",
    "resolve_device",
]
