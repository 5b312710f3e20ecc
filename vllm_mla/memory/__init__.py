"""Who holds how many bytes, and what the allocator saw while they were made."""

from vllm_mla.memory.ledger import OWNERS, Ledger, storage_key
from vllm_mla.memory.peaks import AllocationTrace

__all__ = ["OWNERS", "AllocationTrace", "Ledger", "storage_key"]
