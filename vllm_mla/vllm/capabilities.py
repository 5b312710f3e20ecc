"""What an MLA attention backend allows the lifecycle and the query path to do.

Flags are declared per backend name, default off, and never inferred from other
settings. Upstream backends are absent from the table, so they keep everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_mla.formats import SPARSE_BACKEND
from vllm_mla.weights.absorb import DEFAULT_MAX_SCRATCH_BYTES, LifecycleConfig


class CapabilityError(ValueError):
    """A capability is on for a backend that cannot support it (a start-up error)."""


@dataclass(frozen=True)
class BackendCapabilities:
    """Backend-level flags; ``releases_absorbed_source`` needs MQA-only serving."""

    name: str
    releases_absorbed_source: bool = False
    needs_safe_query_bmm: bool = False
    # The DSA row layout (vllm_mla.vllm.fused_query): the backend's forward_mqa reads a
    # (ql_nope, q_pe) pair whose ql_nope is the left part of one [M, H, L + R] buffer.
    supports_fused_query_projection: bool = False
    serves_extend_through_absorbed: bool = False
    prefers_direct_absorbed: bool = False  # VLLM_MLA_ABSORBED=auto picks direct (measured)

    def __post_init__(self) -> None:
        if self.releases_absorbed_source and not self.serves_extend_through_absorbed:
            raise CapabilityError(
                f"{self.name}: releases_absorbed_source requires "
                "serves_extend_through_absorbed (an MQA-only backend); with a dense MHA "
                "prefill path kv_b_proj is still called"
            )


CAPABILITIES: dict[str, BackendCapabilities] = {
    SPARSE_BACKEND: BackendCapabilities(
        SPARSE_BACKEND,
        releases_absorbed_source=True,
        supports_fused_query_projection=True,
        serves_extend_through_absorbed=True,
    ),
}


def capabilities_for(backend: str) -> BackendCapabilities:
    """The declared flags of ``backend``; all off for a backend not in the table."""
    return CAPABILITIES.get(backend, BackendCapabilities(backend))


def lifecycle_config(
    caps: BackendCapabilities,
    *,
    max_scratch_bytes: int = DEFAULT_MAX_SCRATCH_BYTES,
    absorbed: str = "bf16",
) -> LifecycleConfig:
    """The lifecycle settings a backend's capabilities imply (``absorbed``: bf16/direct)."""
    return LifecycleConfig(
        release_source=caps.releases_absorbed_source,
        dense_mha_prefill=not caps.serves_extend_through_absorbed,
        max_scratch_bytes=max_scratch_bytes,
        absorbed=absorbed,
    )
