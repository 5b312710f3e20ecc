"""Plain-torch sparse MLA: the single oracle for the kernels, tests and benchmarks."""

from __future__ import annotations

import torch

from vllm_mla.ops.sparse_mla.kv_format import LATENT, SparseMLAError, unpack_rows
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, 512] in q's dtype, lse [T, H] fp32)`` computed in fp32.

    Index ``indices[t, j]`` counts when it is >= 0 and ``j < lengths[t]``; a row with
    none gets out 0 and lse -inf. Valid indices must lie inside the cache (checked).
    """
    args = validate(q, kv_cache, indices, kv_format=kv_format, lengths=lengths)
    t, h, k = args.num_tokens, args.num_heads, args.topk
    valid = indices >= 0
    if lengths is not None:
        valid &= torch.arange(k, device=indices.device)[None, :] < lengths[:, None].long()
    rows = torch.where(valid, indices, 0).long()
    num_rows = kv_cache.shape[0] * kv_cache.shape[1]
    if t and bool((rows >= num_rows).any()):
        raise SparseMLAError(f"indices: expected rows < {num_rows} (cache rows), got larger")
    out = torch.zeros(t, h, LATENT, dtype=torch.float32, device=indices.device)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32, device=indices.device)
    step = max(1, _CHUNK_ELEMS // (k * (LATENT + 64)))
    for s in range(0, t, step):
        e = min(t, s + step)
        kv_c, k_pe = unpack_rows(kv_cache, rows[s:e], kv_format)  # [n, K, 512], [n, K, 64]
        scores = torch.einsum("thd,tkd->thk", args.q_nope[s:e].float(), kv_c)
        scores += torch.einsum("thd,tkd->thk", args.q_pe[s:e].float(), k_pe)
        scores = (scores * softmax_scale).masked_fill(~valid[s:e, None, :], float("-inf"))
        chunk_lse = torch.logsumexp(scores, dim=-1)
        empty = torch.isneginf(chunk_lse)[..., None]  # NaN (corrupt rows) propagates
        probs = torch.where(empty, 0.0, torch.exp(scores - chunk_lse[..., None]))
        out[s:e] = torch.einsum("thk,tkd->thd", probs, kv_c)
        lse[s:e] = chunk_lse
    return out.to(args.dtype), lse
