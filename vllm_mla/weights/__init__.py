"""The absorbed-weight lifecycle (plan -> preallocate -> materialize -> release -> reload)."""

from vllm_mla.weights.absorb import (
    AbsorptionPlan,
    LifecycleConfig,
    LifecycleError,
    PostLoadReport,
    ReleaseRefusedError,
    baseline_post_load,
    plan_absorption,
    post_load,
)
from vllm_mla.weights.device import DeviceResolutionError, resolve_device
from vllm_mla.weights.sources import KVBSource, SourceError, read_source

__all__ = [
    "AbsorptionPlan",
    "DeviceResolutionError",
    "KVBSource",
    "LifecycleConfig",
    "LifecycleError",
    "PostLoadReport",
    "ReleaseRefusedError",
    "SourceError",
    "baseline_post_load",
    "plan_absorption",
    "post_load",
    "read_source",
    "resolve_device",
]
