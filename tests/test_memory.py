"""The ledger (bytes per owner, deduped by storage) and allocator traces."""

from __future__ import annotations

import pytest
import torch
from conftest import make_layer

from vllm_mla.memory import AllocationTrace, Ledger
from vllm_mla.tools.standins import build_layer, source_tensors, synthetic_weight
from vllm_mla.weights import LifecycleConfig, baseline_post_load, post_load

MIB = 1 << 20


def test_views_of_one_storage_count_once():
    ledger = Ledger()
    base = torch.empty(1024, dtype=torch.uint8)
    assert ledger.add("absorbed", [base[:10], base[10:], base.view(32, 32).T]) == 1024
    assert ledger.add("source", [base]) == 0  # already owned by "absorbed"
    assert ledger.bytes_of("absorbed") == 1024 and ledger.bytes_of("source") == 0


def test_a_view_holds_its_whole_storage():
    ledger = Ledger()
    assert ledger.add("scratch", [torch.empty(100, dtype=torch.float32)[:1]]) == 400


def test_unknown_owner_is_rejected():
    with pytest.raises(ValueError, match="unknown owner 'weights'"):
        Ledger().add("weights", [])


def test_baseline_bf16_pair_aliases_the_source(geo):
    layer = make_layer(geo, "bf16")
    baseline_post_load(layer, torch.bfloat16)
    row = Ledger().add_layer(layer)
    nbytes = layer.kv_b_proj.weight.untyped_storage().nbytes()
    assert row == {"absorbed": nbytes, "source": 0, "packed": 0}


@pytest.mark.parametrize("fmt", ["fp8-block", "mxfp8"])
def test_baseline_keeps_source_and_lean_releases_it(geo, fmt):
    base, lean = make_layer(geo, fmt), make_layer(geo, fmt)
    source = sum(p.untyped_storage().nbytes() for p in lean.kv_b_proj.parameters())
    baseline_post_load(base, torch.bfloat16)
    post_load(lean, torch.bfloat16, LifecycleConfig(release_source=True, dense_mha_prefill=False))
    b, ln = Ledger(), Ledger()
    b.add_layer(base)
    ln.add_layer(lean)
    assert b.bytes_of("absorbed") == ln.bytes_of("absorbed")
    assert b.bytes_of("source") == source and ln.bytes_of("source") == 0
    assert b.resident_bytes - ln.resident_bytes == source


def test_packed_owner_is_its_own_line(geo):
    """b12x's packed owner (nested dataclasses of tensors) counts as packed, once per storage."""
    held = source_tensors(synthetic_weight(geo, seed=0, layer=0), "mxfp8-b12x")
    layer = build_layer(geo, held)
    owner = layer.kv_b_proj.b12x_mxfp8_packed_weight
    expected = sum(
        t.untyped_storage().nbytes()
        for t in (owner.weight.values, owner.weight.scale_rows, owner.weight.scale_mma)
    )
    post_load(layer, torch.bfloat16)
    row = Ledger().add_layer(layer)
    assert row["packed"] == expected and row["source"] == 0  # weight/weight_scale are empty


def test_trace_separates_transient_from_persistent():
    with AllocationTrace() as trace:
        a = torch.empty(4 * MIB, dtype=torch.uint8)
        b = torch.empty(1 * MIB, dtype=torch.uint8)
        del a
        c = torch.empty(2 * MIB, dtype=torch.uint8)
        d = torch.empty(3 * MIB, dtype=torch.uint8)
        del c, d
    sizes = [(x.size, x.freed) for x in trace.allocations()]
    assert sizes == [(4 * MIB, True), (1 * MIB, False), (2 * MIB, True), (3 * MIB, True)]
    assert trace.transient_peak() == 5 * MIB  # c and d together; a was gone by then
    assert trace.persistent_bytes() == 1 * MIB
    del b


def test_trace_ignores_frees_of_older_storage():
    old = torch.empty(MIB, dtype=torch.uint8)
    with AllocationTrace() as trace:
        del old
        keep = torch.empty(10, dtype=torch.uint8)
    assert trace.transient_peak() == 0 and trace.persistent_bytes() == 10
    del keep


def test_trace_keeps_other_stderr_output(capfd):
    import sys

    with AllocationTrace():
        print("still here", file=sys.stderr)
    err = capfd.readouterr().err
    assert "still here" in err and "USDT" not in err
