"""Cheap content fingerprints of weight storages (to catch weights lost to sleep).

A fingerprint is, per distinct storage, ``(nbytes, checksum)``: the checksum is a
position-weighted sum of at most ``SAMPLE_BYTES`` bytes sampled evenly over the whole
storage, computed on the storage's device with one host copy for all storages at the end
(call it outside CUDA-graph capture: load and reload time, never a decode step). Memory
that was discarded and remapped (vLLM sleep level 2 woken without a reload) reads as
zeros or as another owner's bytes, which changes the checksum unless every sampled byte
happens to match; a storage whose bytes are all rewritten with the same values (a
correct reload) keeps it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

SAMPLE_BYTES = 1 << 16
_MODULUS = 65521  # position weights 1..65521: a swapped or shifted sample changes the sum


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    view = torch.empty(0, dtype=torch.uint8, device=device)
    return view.set_(storage, 0, (storage.nbytes(),), (1,))


def fingerprint(tensors: Iterable[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """``(nbytes, checksum)`` per distinct non-empty storage behind ``tensors``, in first-
    seen order (views of one storage count once; empty tensors are skipped)."""
    seen: set[tuple] = set()
    sums: list[torch.Tensor] = []
    sizes: list[int] = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        data = _bytes_of(storage, tensor.device)
        step = max(1, data.numel() // SAMPLE_BYTES)
        sample = data[::step][:SAMPLE_BYTES].to(torch.int64)
        weights = torch.arange(sample.numel(), device=tensor.device) % _MODULUS + 1
        sums.append((sample * weights).sum())
        sizes.append(storage.nbytes())
    checksums: list[int] = [0] * len(sums)
    for device in {t.device for t in sums}:  # one host copy per device
        where = [i for i, t in enumerate(sums) if t.device == device]
        for i, value in zip(where, torch.stack([sums[i] for i in where]).tolist(), strict=True):
            checksums[i] = int(value)
    return tuple(zip(sizes, checksums, strict=True))
