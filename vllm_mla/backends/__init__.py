"""Attention-backend capabilities (looked up by backend name, default off)."""

from vllm_mla.backends.capabilities import (
    BackendCapabilities,
    CapabilityError,
    capabilities_for,
    lifecycle_config,
)

__all__ = ["BackendCapabilities", "CapabilityError", "capabilities_for", "lifecycle_config"]
