"""Safe mode: the BF16 pair wrapped so that every bmm on it runs the bounds-safe op.

``bind_safe`` turns W_UK_T, W_UV (and a DCP copy of W_UK_T) into dense
``AbsorbedWeight`` parameters over the same storage: no copy, the same addresses, and
``torch.bmm(q, layer.W_UK_T, out=...)`` in unmodified vLLM code runs
``vllm_mla.ops.absorbed_matmul`` (``safe_mla_query_bmm`` for BF16). The lifecycle unwraps
before it refills the pair (``absorb._unwrap_pair``), so binding again is idempotent.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mla.ops.absorbed_weight import AbsorbedWeight

ROUTED = ("W_UK_T", "W_UV", "W_UK_T_dcp_qrep")


def bind_safe(layer: nn.Module) -> list[str]:
    """Wrap the layer's plain pair tensors; returns the names now routed (already or newly)."""
    routed = []
    for name in ROUTED:
        current = getattr(layer, name, None)
        if isinstance(current, AbsorbedWeight):
            routed.append(name)
            continue
        if not isinstance(current, torch.Tensor):
            continue
        inner = current.detach()
        wrapped = nn.Parameter(AbsorbedWeight.dense(inner, name), requires_grad=False)
        layer.__dict__.pop(name, None)
        layer._buffers.pop(name, None)
        layer._parameters[name] = wrapped
        routed.append(name)
    return routed


def routed_kind(layer: nn.Module) -> str | None:
    """``dense`` (safe), ``mxfp8`` (direct) or None: how W_UK_T is routed on ``layer``."""
    w = getattr(layer, "W_UK_T", None)
    return w.kind if isinstance(w, AbsorbedWeight) else None
