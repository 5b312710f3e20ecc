"""Worst-case error bounds for comparing two fp32 computations that sum in different orders.

Kernels (Triton's interpreter on numpy, torch on MKL / oneDNN, their AVX2 / AVX-512 / AMX
blockings) sum in an order each CPU picks, so a test cannot assume one. Any order of an
n-term fp32 sum is within ``(n - 1) * 2**-24 * sum|terms|`` of the exact sum (each term
goes through at most n - 1 roundings); products are rounded once more (or exact). A bound
built from that holds on every CPU; a tolerance read off one machine's output does not.
"""

from __future__ import annotations

import torch

from vllm_mla.ops.sparse_mla import LATENT, unpack_rows

U = 2.0**-24  # fp32 unit roundoff (24-bit significand, round to nearest)
# Per sparse-MLA logit, one side: the 576-term dot, plus a slack of 32 roundings covering
# the products (fp32 q), the fp8 group scale, softmax_scale (and log2 e), the max subtracted.
LOGIT_ROUNDINGS = 576 + 32
# Per logit, one side, when the dots are exact: softmax_scale (and log2 e), the max or lse
# subtracted, each <= 2**-24 of |logit| + |lse|; 8 of them is a slack of 2x.
EXACT_LOGIT_ROUNDINGS = 8
# Per softmax weight / output element, one side, on top of the K-term sums: exp / exp2
# (<= 4 ulp), the 1 / l division, the split-K rescales and merges.
WEIGHT_ROUNDINGS = 28


def grid(x: torch.Tensor) -> int | None:
    """The least g <= 40 with every ``x * 2**g`` an integer (x exact in float64), or None."""
    x = x.double()
    for g in range(41):
        if bool((x * 2.0**g == torch.round(x * 2.0**g)).all()):
            return g
    return None


def exact_dots(q, keys, cache, kv_format) -> bool:
    """Every partial sum of every ``q . k`` is exact in fp32, in any order: q and the keys
    on binary grids (products multiples of 2**-g) with sum|q k| <= 2**(24 - g), and for
    fp8 power-of-two group scales (the kernel scales a piece after its dot)."""
    gq, gk = grid(q), grid(keys)
    if gq is None or gk is None or q.numel() == 0 or keys.numel() == 0:
        return False
    magnitude = torch.einsum("thd,tkd->thk", q.abs(), keys.abs())
    if float(magnitude.max()) * 2.0 ** (gq + gk) > 2.0**24:
        return False
    if kv_format == "fp8_ds_mla":
        # a copy: a one-row slice is already contiguous, at any (unaligned) offset
        scales = (
            cache[..., LATENT : LATENT + 16]
            .clone(memory_format=torch.contiguous_format)
            .view(torch.float32)
        )
        return bool((torch.frexp(scales).mantissa.abs() == 0.5).all())
    return True


def sparse_mla_bound(q, cache, indices, scale, kv_format, lengths=None, *, sides=2, sink=None):
    """``(out_tol [T, H, 512], lse_tol [T, H])`` float64: |a - b| for two fp32 sparse-MLA
    evaluations of the same inputs in any summation orders (``sides=2``), or for one
    against the exact result (``sides=1``). Rounding of the output dtype not included.

    Per side: a logit is off by ``e = LOGIT_ROUNDINGS * u * A`` at most, ``A`` the largest
    ``scale * sum_d |q_d k_d|`` of the row (with ``exact_dots``: ``e = EXACT_LOGIT_ROUNDINGS
    * u * (max |logit| + |lse|)``, 2-3 orders of magnitude less); a softmax weight by ``2 e``
    (its logit and the normaliser) plus ``(K + WEIGHT_ROUNDINGS) u`` (the K-term sum l);
    ``out_d = sum_j w_j v_jd`` adds ``K u`` of ``M_d = sum_j w_j |v_jd|``. So
    ``|d out_d| <= (2 e + (2 K + WEIGHT_ROUNDINGS) u) M_d`` and
    ``|d lse| <= e + (K + WEIGHT_ROUNDINGS) u + 4 u |lse|``.

    ``sink`` (fp32 ``[H]``): one more logit per head in the denominator, so the weights,
    ``M_d`` and ``lse`` are the sink-softmax's, the sums have ``K + 1`` terms, and ``e``
    also bounds the sink logit's error, ``EXACT_LOGIT_ROUNDINGS * u * (|sink| + |lse|)``
    (its ``log2 e`` and ``ln 2`` roundings and the max subtracted; no dot)."""
    q_nope, q_pe = (q[..., :LATENT], q[..., LATENT:]) if torch.is_tensor(q) else q
    q = torch.cat([q_nope.cpu().double(), q_pe.cpu().double()], -1)
    idx = indices.cpu().long()
    k = idx.shape[1]
    if idx.numel() == 0:  # no token, or no index: nothing is summed, out 0 and lse -inf
        return torch.zeros(*q.shape[:2], LATENT, dtype=q.dtype), torch.zeros(q.shape[:2]).double()
    valid = (idx >= 0) & (idx < cache.shape[0] * cache.shape[1])
    if lengths is not None:
        valid &= torch.arange(k)[None, :] < lengths.cpu().long()[:, None]
    rope = q_pe.shape[-1]  # 64, or 0 (no RoPE: the keys are kv_c alone)
    kv_c, k_pe = unpack_rows(cache.cpu(), torch.where(valid, idx, 0), kv_format, rope)
    keys = torch.cat([kv_c, k_pe], -1).double()  # [T, K, 512 + rope]
    mask = ~valid[:, None, :]
    a = scale * torch.einsum("thd,tkd->thk", q.abs(), keys.abs()).masked_fill(mask, 0.0)
    s = scale * torch.einsum("thd,tkd->thk", q, keys).masked_fill(mask, float("-inf"))
    if sink is None:
        w = torch.softmax(s, -1).nan_to_num(0.0)  # a row without a valid index: all 0
        lse = torch.logsumexp(s, -1)
        sink_abs = torch.zeros(())
    else:
        k += 1  # the sink: one more term of every sum over the row
        sinks = sink.cpu().double()[None, :, None].expand(*s.shape[:2], 1)
        lse = torch.logsumexp(torch.cat([s, sinks], -1), -1)
        w = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        sink_abs = sinks[..., 0].abs().nan_to_num(0.0, posinf=0.0)
    m = torch.einsum("thk,tkd->thd", w, keys[..., :LATENT].abs())
    lse = lse.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    if exact_dots(q, keys.masked_fill(~valid[..., None], 0.0), cache, kv_format):
        s_max = torch.maximum(s.abs().masked_fill(mask, 0.0).amax(-1), sink_abs)
        e = EXACT_LOGIT_ROUNDINGS * U * (s_max + lse.abs())
    else:
        e = LOGIT_ROUNDINGS * U * a.amax(-1)
        if sink is not None:  # the sink logit's own roundings, as an exact logit's
            e = torch.maximum(e, EXACT_LOGIT_ROUNDINGS * U * (sink_abs + lse.abs()))
    out_tol = sides * (torch.expm1(2 * e) + (2 * k + WEIGHT_ROUNDINGS) * U)[..., None] * m
    lse_tol = sides * (e + (k + WEIGHT_ROUNDINGS) * U + 4 * U * lse.abs())
    return out_tol, lse_tol
