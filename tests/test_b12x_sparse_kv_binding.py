"""KV-pool binding: formats declared without allocation; views never pin a dead pool.

Storage liveness on CPU is observed through a numpy array backing the pool: the array
dies only when no tensor anywhere references the storage.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from vllm_mla.backends.b12x_sparse import (
    CacheWriterFormat,
    KVPoolReleased,
    LayerKVBinding,
    storage_alias,
)
from vllm_mla.memory import AllocationTrace

FMT = CacheWriterFormat("fp8_ds_mla", 64)


def pool(blocks: int, interleave: int = 1) -> tuple[torch.Tensor, weakref.ref]:
    """A ``[blocks, 64, 656]`` uint8 pool whose block stride spans ``interleave`` pages."""
    backing = np.zeros((blocks, interleave, 64, 656), dtype=np.uint8)
    if interleave == 1:  # a base tensor, not a view: views of it would keep it alive
        return torch.from_numpy(backing.reshape(blocks, 64, 656)), weakref.ref(backing)
    pages = torch.from_numpy(backing)[:, 0]  # other layers' pages sit between blocks
    return pages, weakref.ref(backing)


def indexer_k(alias: torch.Tensor, fmt: CacheWriterFormat) -> torch.Tensor:
    return alias[..., :16]  # stands in for an indexer's K-cache view of the pool


def test_format_is_declared_without_allocating():
    with AllocationTrace("cpu") as trace:
        fmt = CacheWriterFormat("bf16", 128)
        sizes = (fmt.row_width, fmt.row_bytes, fmt.block_bytes())
    # torch.empty(()) for the element size is the only allocation, scalar-sized
    assert all(a.size <= 8 for a in trace.allocations())
    assert sizes == (576, 1152, 128 * 1152)
    assert (FMT.row_width, FMT.row_bytes) == (656, 656)
    with pytest.raises(ValueError, match="multiple of 64, got 32"):
        CacheWriterFormat("bf16", 32)


def test_writer_view_addresses_rows_through_the_block_stride():
    p, _ = pool(3, interleave=2)
    binding = LayerKVBinding("layer.0", FMT)
    assert binding.sync(p) and not binding.sync(p)  # second sync: same pool, no rebind
    rows = binding.writer()
    assert binding.block_stride_rows == 128
    rows[2 * 128 + 5, 7] = 9  # block 2, offset 5 in the flat row view
    assert p[2, 5, 7] == 9


def test_replaced_pool_is_released_and_rebound():
    binding = LayerKVBinding("layer.0", FMT, {"indexer_k": indexer_k})
    profiling, profiling_alive = pool(1)
    binding.sync(profiling)
    old_views = [weakref.ref(binding.writer()), weakref.ref(binding.view("indexer_k"))]
    real, _ = pool(4)
    assert binding.sync(real)  # vLLM swapped pools: detected by identity
    del profiling
    gc.collect()
    assert profiling_alive() is None and all(ref() is None for ref in old_views)
    assert binding.view("indexer_k").untyped_storage().data_ptr() == real.data_ptr()
    assert binding.rebinds == 2


def test_released_pool_drops_views_without_a_rebind():
    binding = LayerKVBinding("layer.0", FMT, {"indexer_k": indexer_k})
    profiling, alive = pool(1)
    binding.sync(profiling)
    del profiling  # the owner (vLLM) releases the pool; nobody calls the binding
    gc.collect()
    assert alive() is None and not binding.bound
    with pytest.raises(KVPoolReleased):
        binding.writer()


def test_control_views_of_the_pool_itself_would_pin_it(monkeypatch):
    # Control: build views from the pool tensor instead of a storage alias, as a naive
    # binding would; the pool then never dies and the rule above would fail.
    monkeypatch.setattr("vllm_mla.backends.b12x_sparse.kv_binding.storage_alias", lambda pool: pool)
    binding = LayerKVBinding("layer.0", FMT, {"indexer_k": indexer_k})
    profiling, alive = pool(1)
    binding.sync(profiling)
    del profiling
    gc.collect()
    assert alive() is not None and binding.bound
    binding.release()
    gc.collect()
    assert alive() is None


def test_control_without_the_finalizer_a_released_pool_stays_pinned(monkeypatch):
    monkeypatch.setattr(
        "vllm_mla.backends.b12x_sparse.kv_binding._pool_collected", lambda *args: None
    )
    binding = LayerKVBinding("layer.0", FMT)
    profiling, alive = pool(1)
    binding.sync(profiling)
    del profiling
    gc.collect()
    assert alive() is not None and binding.bound


def test_control_a_binding_that_keeps_old_views_pins_the_old_pool():
    binding = LayerKVBinding("layer.0", FMT)
    profiling, alive = pool(1)
    binding.sync(profiling)
    kept = binding.writer()  # what a binding without release-on-rebind would keep
    binding.sync(pool(2)[0])
    del profiling
    gc.collect()
    assert alive() is not None
    del kept
    gc.collect()
    assert alive() is None


def test_empty_placeholder_releases_and_bad_pools_are_rejected():
    binding = LayerKVBinding("layer.0", FMT)
    p, _ = pool(1)
    binding.sync(p)
    assert not binding.sync(torch.tensor([])) and not binding.bound
    with pytest.raises(ValueError, match=r"expected torch.uint8 \[blocks, k\*64, 656\]"):
        binding.sync(torch.zeros(2, 64, 576, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"got torch.uint8 \[2, 96, 656\]"):
        binding.sync(torch.zeros(2, 96, 656, dtype=torch.uint8))
    wide = torch.zeros(2, 128, 656, dtype=torch.uint8)  # 128-row blocks: two pages each
    assert binding.sync(wide) and binding.writer().shape == (256, 656)
    alias = storage_alias(p)
    assert alias._base is None and alias.data_ptr() == p.data_ptr()
