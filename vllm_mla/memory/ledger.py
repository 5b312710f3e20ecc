"""Bytes per owner, deduped by storage.

Owners of an MLA layer: ``absorbed`` (W_UK_T, W_UV and DCP copies), ``source``
(kv_b_proj's checkpoint tensors), ``packed`` (forms a backend derived from the
source). A storage shared by several owners counts once, for the first owner in
``OWNERS`` order (upstream's absorbed views alias a BF16 source, for example).
Bytes are whole storages, since a view keeps its entire storage alive. Routed weights
(``AbsorbedWeight``) count the storage they wrap: in direct mode the pack's, once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

OWNERS = ("absorbed", "source", "packed", "scratch", "workspace", "cache")
ABSORBED_ATTRS = ("W_UK_T", "W_UV", "W_UK_T_dcp_qrep")


def storage_key(tensor: torch.Tensor) -> tuple:
    """Identity of the storage behind ``tensor`` (same for every view of it)."""
    return (tensor.device, tensor.untyped_storage().data_ptr())


def layer_owners(layer: nn.Module) -> dict[str, list[torch.Tensor]]:
    """The tensors each owner holds in one MLA layer."""
    # Imported here: weights depends on memory, never the other way round at import time.
    from vllm_mla.weights.forms import PACKED_ATTRS
    from vllm_mla.weights.sources import packed_tensors

    absorbed = []
    for attr in ABSORBED_ATTRS:
        t = getattr(layer, attr, None)
        if isinstance(t, torch.Tensor):
            # a routed weight (vllm_mla.ops.AbsorbedWeight) holds other tensors' storage
            inner = getattr(t, "inner_tensors", None)
            absorbed.extend(inner() if callable(inner) else [t])
    kv_b = layer.kv_b_proj
    source = [*kv_b.parameters(), *kv_b.buffers()]
    packed = [t for attr in PACKED_ATTRS for t in packed_tensors(kv_b, attr)]
    return {"absorbed": absorbed, "source": source, "packed": packed}


class Ledger:
    """Accumulates owners over layers; each storage is counted once."""

    def __init__(self) -> None:
        self._owner_of: dict[tuple, str] = {}
        self._bytes: dict[tuple, int] = {}
        self.per_layer: list[dict[str, int]] = []

    def add(self, owner: str, tensors: Iterable[torch.Tensor]) -> int:
        """Attribute ``tensors`` to ``owner``; returns the bytes newly counted."""
        if owner not in OWNERS:
            raise ValueError(f"unknown owner {owner!r}; expected one of {OWNERS}")
        added = 0
        for tensor in tensors:
            if tensor.numel() == 0:
                continue
            key = storage_key(tensor)
            if key in self._owner_of:
                continue
            self._owner_of[key] = owner
            self._bytes[key] = tensor.untyped_storage().nbytes()
            added += self._bytes[key]
        return added

    def add_layer(self, layer: nn.Module) -> dict[str, int]:
        """Walk one MLA layer; returns its bytes per owner (and records them)."""
        row = {owner: self.add(owner, ts) for owner, ts in layer_owners(layer).items()}
        self.per_layer.append(row)
        return row

    def bytes_of(self, owner: str) -> int:
        return sum(b for k, b in self._bytes.items() if self._owner_of[k] == owner)

    @property
    def resident_bytes(self) -> int:
        """absorbed + source + packed: what the weights hold after post-load."""
        return sum(self.bytes_of(o) for o in ("absorbed", "source", "packed"))
