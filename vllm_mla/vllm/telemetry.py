"""What the plugin's patches did in this process, for reading back from vLLM workers.

vLLM runs post-load and the forward pass in its worker processes; a test or an
operator reads this record there through ``LLM.apply_model`` / ``collective_rpc``
(``snapshot()`` is plain data, so it pickles back). Counters are per process and
cheap (one dict update per patched call); under CUDA-graph replay Python does not
run, so query counts cover eager steps and captures only.
"""

from __future__ import annotations

import os
from collections import Counter

from torch import nn

from vllm_mla.memory import Ledger
from vllm_mla.ops import absorbed_matmul, query_fusion

_post_load: list[tuple[str, str]] = []
_query: Counter[str] = Counter()
_sparse: Counter[str] = Counter()


def record_post_load(layer_name: str, outcome: str) -> None:
    """One MLA post-load: the layer and what the lifecycle did (or why it delegated)."""
    _post_load.append((layer_name, outcome))


def record_query(path: str) -> None:
    """One patched query-path call and the path it took."""
    _query[path] += 1


def record_sparse(event: str) -> None:
    """One sparse-backend call (``forward_mqa:<impl>``, ``kv_write:<format>``, ``indexer:cpu``)."""
    _sparse[event] += 1


def snapshot() -> dict:
    """This process's record: pid, post-loads in order, query-path, absorbed-BMM, fused
    query projection and sparse counts (``absorbed``: ``path:role`` from
    ``vllm_mla.ops.absorbed_matmul.calls``; ``fused_query``: ``consumer:path`` per projection
    and ``flushed:why`` per deferred bmm run late, from ``vllm_mla.ops.query_fusion.calls``)."""
    return {
        "pid": os.getpid(),
        "post_load": list(_post_load),
        "query": dict(_query),
        "absorbed": absorbed_matmul.calls(),
        "fused_query": query_fusion.calls(),
        "sparse": dict(_sparse),
    }


def reset() -> None:
    """Forget everything recorded (tests)."""
    _post_load.clear()
    _query.clear()
    _sparse.clear()
    absorbed_matmul.reset_calls()
    query_fusion.reset_calls()


def ledger_by_layer(model: nn.Module) -> dict[str, dict[str, int]]:
    """Bytes per owner of every MLA attention layer in ``model`` (deduped per layer)."""
    report = {}
    for name, module in model.named_modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "W_UK_T"):
            ledger = Ledger()
            report[name] = ledger.add_layer(module)
    return report
