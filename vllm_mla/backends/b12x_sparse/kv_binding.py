"""Per-layer KV-pool binding: cache-writer and indexer views that never pin a dead pool.

vLLM allocates a minimal profiling KV pool, captures and tears down graphs, then
binds the real pool; it has no "KV cache changed" hook for an attention impl. A
``LayerKVBinding`` therefore:

- declares the cache-writer format (``CacheWriterFormat``) from sizes alone: no
  token-sized allocation ever;
- on ``sync(pool)`` compares the pool's identity (storage, data_ptr, shape, strides,
  dtype, device) with the bound one; on a change it drops every view of the old pool
  before building views of the new one;
- drops its views as soon as the pool tensor it was bound to is garbage (a
  ``weakref.finalize`` on that tensor), so views never outlive the owner's release;
- never holds the pool tensor itself, only views of the current pool and integers.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_mla.backends.b12x_sparse.preparation import KV_FORMATS, record_width


class KVPoolReleased(RuntimeError):
    """A view was asked for while no live KV pool is bound."""


@dataclass(frozen=True)
class CacheWriterFormat:
    """What the cache writer writes, declared from sizes (allocates nothing)."""

    kv_format: str
    block_size: int

    def __post_init__(self) -> None:
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {self.kv_format!r}")
        if self.block_size < 1 or self.block_size % 64:
            raise ValueError(f"block_size: expected a multiple of 64, got {self.block_size}")

    @property
    def row_width(self) -> int:
        """Elements per cache row (656 uint8 for fp8_ds_mla, 576 bf16 for bf16)."""
        return record_width(self.kv_format)[0]

    @property
    def dtype(self) -> torch.dtype:
        return record_width(self.kv_format)[1]

    @property
    def row_bytes(self) -> int:
        return self.row_width * torch.empty((), dtype=self.dtype).element_size()

    def block_bytes(self) -> int:
        return self.block_size * self.row_bytes

    def check(self, pool: torch.Tensor) -> None:
        """Raise unless ``pool`` is a ``[blocks, rows, row_width]`` cache of this format
        whose block rows are a multiple of ``block_size`` (the declared page)."""
        shape_ok = pool.dim() == 3 and pool.shape[-1] == self.row_width
        if pool.dtype != self.dtype or not shape_ok or pool.shape[1] % self.block_size:
            raise ValueError(
                f"KV pool: expected {self.dtype} [blocks, k*{self.block_size}, "
                f"{self.row_width}] for {self.kv_format}, got {pool.dtype} {list(pool.shape)}"
            )
        if pool.stride(2) != 1 or pool.stride(1) != self.row_width:
            raise ValueError(
                f"KV pool: rows must be dense ({self.row_width}, 1), got strides {pool.stride()}"
            )
        if pool.stride(0) % self.row_width:
            raise ValueError(
                f"KV pool: block stride {pool.stride(0)} is not a whole number of "
                f"{self.row_width}-element rows"
            )


def pool_identity(pool: torch.Tensor) -> tuple:
    """What makes two pool tensors the same memory laid out the same way."""
    storage = pool.untyped_storage()
    return (
        storage._cdata,  # the storage object itself (its address), not a Python wrapper
        storage.data_ptr(),
        pool.data_ptr(),
        tuple(pool.shape),
        pool.stride(),
        pool.dtype,
        pool.device,
    )


def storage_alias(pool: torch.Tensor) -> torch.Tensor:
    """A tensor over ``pool``'s storage with its geometry, not a view of ``pool``.

    A view keeps its base tensor object alive (PyTorch preserves the base's Python
    object while a view references it), which would stop the pool's finalizer from
    ever firing; an alias made with ``set_`` references the storage only.
    """
    alias = torch.empty(0, dtype=pool.dtype, device=pool.device)
    return alias.set_(pool.untyped_storage(), pool.storage_offset(), pool.shape, pool.stride())


def flat_rows(pool: torch.Tensor, fmt: CacheWriterFormat) -> tuple[torch.Tensor, int]:
    """(flat ``[rows, row_width]`` view, physical rows per block) of a paged pool.

    A block's rows start at ``block * block_stride_rows``; other layers' pages may sit
    between this layer's blocks, so ``block_stride_rows >= block_size``.
    """
    stride_rows = pool.stride(0) // fmt.row_width
    rows = (pool.shape[0] - 1) * stride_rows + pool.shape[1] if pool.shape[0] else 0
    return pool.as_strided((rows, fmt.row_width), (fmt.row_width, 1)), stride_rows


ViewBuilder = Callable[[torch.Tensor, CacheWriterFormat], torch.Tensor]


class LayerKVBinding:
    """Views of one layer's current KV pool; see the module docstring for the rules.

    ``indexer_views`` maps a name to a function building that view from the pool
    (e.g. the indexer's K cache view); they are rebuilt on every rebind. Builders get a
    storage alias of the pool (``storage_alias``), never the pool tensor itself.
    """

    def __init__(
        self,
        layer_name: str,
        fmt: CacheWriterFormat,
        indexer_views: dict[str, ViewBuilder] | None = None,
    ) -> None:
        self.layer_name = layer_name
        self.format = fmt
        self._builders = dict(indexer_views or {})
        self._identity: tuple | None = None
        self._generation = itertools.count()
        self._bound_generation = -1
        self._finalizer: weakref.finalize | None = None
        self._writer: torch.Tensor | None = None
        self._block_stride_rows = 0
        self._views: dict[str, torch.Tensor] = {}
        self.rebinds = 0

    @property
    def bound(self) -> bool:
        return self._writer is not None

    def sync(self, pool: torch.Tensor) -> bool:
        """Bind ``pool`` unless it is the bound one; True when (re)bound.

        An empty pool (vLLM's placeholder before/after allocation) releases the views.
        """
        if pool.numel() == 0:
            self.release()
            return False
        identity = pool_identity(pool)
        if identity == self._identity and self.bound:
            return False
        self.release()  # drop the old pool's views before building new ones
        self.format.check(pool)
        alias = storage_alias(pool)
        self._writer, self._block_stride_rows = flat_rows(alias, self.format)
        self._views = {name: build(alias, self.format) for name, build in self._builders.items()}
        del alias
        self._identity = identity
        generation = next(self._generation)
        self._bound_generation = generation
        self_ref = weakref.ref(self)
        # Holds only a weak reference to self and the generation number: the finalizer
        # must keep neither the binding nor the pool alive.
        self._finalizer = weakref.finalize(pool, _pool_collected, self_ref, generation)
        self.rebinds += 1
        return True

    def release(self) -> None:
        """Drop every view of the bound pool (the pool is released or replaced)."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self._writer = None
        self._views = {}
        self._identity = None
        self._bound_generation = -1

    def writer(self) -> torch.Tensor:
        """The cache-writer view: flat ``[rows, row_width]`` rows of the bound pool."""
        if self._writer is None:
            raise KVPoolReleased(f"{self.layer_name}: no live KV pool is bound")
        return self._writer

    @property
    def block_stride_rows(self) -> int:
        self.writer()
        return self._block_stride_rows

    def view(self, name: str) -> torch.Tensor:
        """A named indexer view of the bound pool."""
        if self._writer is None:
            raise KVPoolReleased(f"{self.layer_name}: no live KV pool is bound")
        if name not in self._views:
            raise KeyError(f"{self.layer_name}: no view {name!r} (known: {sorted(self._views)})")
        return self._views[name]

    def _collected(self, generation: int) -> None:
        if generation == self._bound_generation:
            self._finalizer = None
            self.release()


def _pool_collected(binding_ref: weakref.ref, generation: int) -> None:
    binding = binding_ref()
    if binding is not None:
        binding._collected(generation)
