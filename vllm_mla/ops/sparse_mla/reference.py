"""Plain-torch sparse MLA: the single oracle for the kernels, tests and benchmarks."""

from __future__ import annotations

import torch

from vllm_mla.ops.sparse_mla.formats import LATENT, cache_rows, unpack_rows
from vllm_mla.ops.sparse_mla.validate import Query, validate

_CHUNK_ELEMS = 1 << 27  # gathered fp32 values per token chunk (~512 MiB), bounds memory


def sparse_mla_reference(
    q: Query,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    kv_format: str,
    lengths: torch.Tensor | None = None,
    invalid: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, 512] in q's dtype, lse [T, H] fp32)`` computed in fp32.

    ``q``: ``[T, H, 512 + R]`` or ``(q_nope, q_pe [T, H, R])``, R = 64 or 0 (no RoPE: the
    scores are ``q_nope . kv_c`` alone; the cache's records are R's, ``formats``).

    Index ``indices[t, j]`` counts when it is in ``[0, cache rows)`` and ``j < lengths[t]``;
    a row with none gets out 0 and lse -inf. Out-of-range indices follow ``INDEX_RULE``
    (empty, counted into ``invalid`` when given).

    ``sink`` (fp32 ``[H]``, natural-log logits, not scaled by ``softmax_scale``): one more
    logit per head in the softmax denominator only, as HY-V4's: ``out = sum_j e^{x_j} v_j /
    (sum_j e^{x_j} + e^{sink_h})``, ``lse = log(sum_j e^{x_j} + e^{sink_h})`` (the sink
    counted, so vLLM's DCP merge of per-rank LSEs stays exact when one rank adds it); a
    row with no valid index gets out 0 and lse ``sink_h``; a -inf sink is no sink.
    """
    args = validate(
        q, kv_cache, indices, kv_format=kv_format, lengths=lengths, invalid=invalid, sink=sink
    )
    t, h, k = args.num_tokens, args.num_heads, args.topk
    live = torch.ones_like(indices, dtype=torch.bool)
    if lengths is not None:
        live &= torch.arange(k, device=indices.device)[None, :] < lengths[:, None].long()
    in_range = (indices >= -1) & (indices < cache_rows(kv_cache))
    if invalid is not None:
        invalid += (live & ~in_range).sum().to(torch.int32)
    valid = live & in_range & (indices >= 0)
    rows = torch.where(valid, indices, 0).long()
    out = torch.zeros(t, h, LATENT, dtype=torch.float32, device=indices.device)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=indices.device)
    step = max(1, _CHUNK_ELEMS // (k * (LATENT + args.rope)))
    for s in range(0, t, step):
        e = min(t, s + step)
        kv_c, k_pe = unpack_rows(kv_cache, rows[s:e], kv_format, args.rope)  # [n, K, 512 | R]
        scores = torch.einsum("thd,tkd->thk", args.q_nope[s:e].float(), kv_c)
        if args.rope:  # rope 0: no q_pe . k_pe term
            scores += torch.einsum("thd,tkd->thk", args.q_pe[s:e].float(), k_pe)
        scores = (scores * softmax_scale).masked_fill(~valid[s:e, None, :], float("-inf"))
        if sink is None:
            chunk_lse = torch.logsumexp(scores, dim=-1)
        else:  # the sink joins the denominator (the lse) only, never the weighted sum
            sinks = sink[None, :, None].expand(e - s, h, 1)
            chunk_lse = torch.logsumexp(torch.cat([scores, sinks], dim=-1), dim=-1)
        empty = torch.isneginf(chunk_lse)[..., None]  # NaN (corrupt rows) propagates
        probs = torch.where(empty, 0.0, torch.exp(scores - chunk_lse[..., None]))
        out[s:e] = torch.einsum("thk,tkd->thd", probs, kv_c)
        lse[s:e] = chunk_lse
    return out.to(args.dtype), lse
