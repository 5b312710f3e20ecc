"""Top-k selection: with an indexer only the indexer is kept, read on every call."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_mla.ops.sparse_mla import SelectionUnavailable, TopkSelection


def buffer(rows: int = 8, topk: int = 4) -> tuple[torch.Tensor, weakref.ref]:
    backing = np.full((rows, topk), -1, dtype=np.int32)
    return torch.from_numpy(backing), weakref.ref(backing)


def test_indexer_owned_buffer_is_resolved_per_call_and_never_shadowed():
    draft, draft_alive = buffer()
    indexer = SimpleNamespace(topk_indices_buffer=draft)
    selection = TopkSelection(indexer, draft)  # vLLM passes both
    assert selection.owned_by_indexer and selection.resolve(3).data_ptr() == draft.data_ptr()
    target, _ = buffer()
    indexer.topk_indices_buffer = target  # MTP re-points the draft indexer
    del draft
    gc.collect()
    assert draft_alive() is None  # no shadow copy of the old buffer is kept
    assert selection.resolve(2).data_ptr() == target.data_ptr()


def test_control_upstream_style_fallback_field_pins_the_draft_buffer():
    # Control: an impl that keeps the explicit buffer next to the indexer (as vLLM's
    # SharedTopkIndicesBuffer does) keeps the re-pointed draft buffer alive.
    class Shadowing(TopkSelection):
        __slots__ = ("shadow",)

        def __init__(self, indexer, buf):
            super().__init__(indexer, buf)
            self.shadow = buf

    draft, draft_alive = buffer()
    indexer = SimpleNamespace(topk_indices_buffer=draft)
    selection = Shadowing(indexer, draft)
    indexer.topk_indices_buffer = buffer()[0]
    del draft
    gc.collect()
    assert draft_alive() is not None
    del selection
    gc.collect()
    assert draft_alive() is None


def test_explicit_buffer_without_indexer_and_setter_precedence():
    own, _ = buffer()
    selection = TopkSelection(None, own)
    assert not selection.owned_by_indexer and selection.resolve(8) is not None
    other, _ = buffer()
    indexed = TopkSelection(SimpleNamespace(topk_indices_buffer=own), None)
    indexed.set_buffer(other)  # an explicit assignment supersedes the indexer
    assert indexed.indexer is None and indexed.buffer() is other


def test_typed_errors():
    with pytest.raises(SelectionUnavailable, match=r"indexer\.topk_indices_buffer is None"):
        TopkSelection(SimpleNamespace(topk_indices_buffer=None)).resolve(1)
    with pytest.raises(ValueError, match="expected at least 9 rows, got 8"):
        TopkSelection(None, buffer()[0]).resolve(9)
    with pytest.raises(TypeError, match="expected int32"):
        TopkSelection(None, torch.zeros(2, 2, dtype=torch.int64)).resolve(1)


def test_logical_to_physical_matches_a_hand_computation():
    from vllm_mla.ops.sparse_mla import logical_to_physical

    block_table = torch.tensor([[7, 2, 0], [4, 5, 0]], dtype=torch.int32)
    req_id = torch.tensor([1, 0], dtype=torch.int32)
    topk = torch.tensor([[0, 65, -1, 200], [63, 64, 130, 5]], dtype=torch.int32)
    out = logical_to_physical(req_id, block_table, topk, 64)
    # token 0 (req 1): 0 -> 4*64; 65 -> 5*64+1; -1 -> -1; 200 -> block 3 past table -> -1
    # token 1 (req 0): 63 -> 7*64+63; 64 -> 2*64; 130 -> 0*64+2; 5 -> 7*64+5
    expected = [[256, 321, -1, -1], [511, 128, 2, 453]]
    assert out.tolist() == expected and out.dtype == torch.int32


def test_a_checked_buffer_skips_its_checks_but_a_new_one_is_checked():
    good, _ = buffer()
    indexer = SimpleNamespace(topk_indices_buffer=good)
    selection = TopkSelection(indexer)
    assert selection.resolve(2).shape[0] == 2  # checked once
    with pytest.raises(ValueError, match="expected at least 9 rows, got 8"):
        selection.resolve(9)  # the fast path still bounds the row count
    indexer.topk_indices_buffer = torch.zeros(8, 4, dtype=torch.int64)  # re-pointed, bad
    with pytest.raises(TypeError, match="expected int32"):
        selection.resolve(1)
