"""Run the decode query ops on tensors placed at the very end of their allocations.

Meant to run under ``compute-sanitizer --tool memcheck``: any read past a view's
end lands outside the allocation and is reported. Exits non-zero on a wrong result.
"""

from __future__ import annotations

import sys

import torch

from vllm_mla.ops import query_bmm
from vllm_mla.ops.query_projection import mla_query_projection

R, V = 64, 128


def tail(shape, dtype=torch.bfloat16):
    numel = 1
    for s in shape:
        numel *= s
    flat = torch.empty(numel + 1, dtype=dtype, device="cuda")
    view = flat[1:].view(shape)
    view.copy_(torch.randn(shape, device="cuda").to(dtype))
    return view


def main() -> int:
    safe_only = "--safe-only" in sys.argv  # racecheck/synccheck: the CUDA op's smem pipeline
    bad = 0
    for h, t, q_dim, latent in [
        (11, 1, 128, 512),
        (16, 7, 192, 512),
        (1, 33, 40, 48),
        (8, 64, 128, 512),
    ]:
        q = tail((t, h, q_dim + R))  # decode layout; the view below is strided
        w = tail((h, q_dim + V, latent))[:, :q_dim]
        query = q[..., :q_dim].transpose(0, 1)
        out = tail((t, h, latent)).transpose(0, 1)
        query_bmm.safe_mla_query_bmm(query, w, out)
        want = torch.bmm(query.contiguous(), w.contiguous())
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        print(f"safe_mla_query_bmm H={h} T={t} Q={q_dim} L={latent}: rel err {err:.2e}")
        bad += err > 1e-2  # 2 bf16 roundings (<= 2 * 2**-8 of the norm) + fp32 order ~1e-4
        if latent == 512 and q_dim in (128, 192) and not safe_only:
            full = tail((t, h, latent + R))
            mla_query_projection(q[..., :q_dim], w, q[..., q_dim:], full)
            print(f"mla_query_projection H={h} M={t} P={q_dim}: ok")
    torch.cuda.synchronize()
    print("cuda op built:", query_bmm.cuda_op_available(), query_bmm.cuda_op_error() or "")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
