"""Weight fingerprints: one per storage, stable under identical rewrites, changed by loss."""

from __future__ import annotations

import torch

from vllm_mla.weights.fingerprint import SAMPLE_BYTES, fingerprint


def test_one_entry_per_storage_and_empty_tensors_skipped():
    a = torch.randn(64, 32)
    prints = fingerprint([a, a[3:], a.t(), torch.empty(0), torch.ones(5)])
    assert [size for size, _ in prints] == [a.untyped_storage().nbytes(), 20]


def test_identical_rewrite_keeps_it_and_any_loss_changes_it():
    w = torch.randn(300, 577).bfloat16()  # more bytes than the sample: strided sampling
    assert w.untyped_storage().nbytes() > SAMPLE_BYTES
    before = fingerprint([w])
    w.copy_(w.clone())  # a correct reload: the same bytes
    assert fingerprint([w]) == before
    for lost in (torch.zeros_like(w), torch.randn_like(w)):  # remapped: zeros or others' bytes
        assert fingerprint([lost]) != before
    swapped = w.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # same bytes, other places: position-weighted
    assert fingerprint([swapped]) != before


def test_fp8_and_subclass_free_storages_are_read_as_bytes():
    q = torch.randn(16, 16).to(torch.float8_e4m3fn)
    assert fingerprint([q])[0][0] == 256
