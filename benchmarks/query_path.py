"""Decode query path: staged (bmm + cat [+ quant]) vs safe op vs fused, per layer.

Correctness gate first (fresh random inputs, poisoned outputs, the query placed at
the end of its allocation), then CUDA-graph replay timing. Each graph replays
``LAYERS`` calls, each on its own layer's weights (so the weights stream from HBM
as in a real decode step, not from L2); per-layer time = replay time / LAYERS.
Roofline: bytes of weight + q + out over the copy bandwidth measured in the same
run. Prints a table and writes JSON (GPU, versions, commit, every figure).

    python benchmarks/query_path.py [--out results.json] [--quick]
    python benchmarks/query_path.py --smoke   # CPU: the gate only, Triton interpreter
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import common

from vllm_mla.ops import query_bmm
from vllm_mla.ops.base import MXFP8Weight
from vllm_mla.ops.query_projection import (
    can_fuse_query_projection,
    mla_query_projection,
    prewarm_query_projection,
    staged_query_projection,
)
from vllm_mla.ops.query_projection import reference as qp_reference
from vllm_mla.quant import mxfp8

L, R, V = 512, 64, 128
LAYERS = 16
MS, HS, PS = (1, 2, 4, 8, 16, 32), (8, 11, 16, 32), (128, 192)
WEIGHTS, OUTS = ("bf16", "mxfp8"), (torch.bfloat16, torch.float8_e4m3fn)


def tail_view(shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """A contiguous tensor placed at the very end of its own allocation (over-reads fault)."""
    numel = 1
    for s in shape:
        numel *= s
    pad = 4096 // torch.empty((), dtype=dtype).element_size()
    flat = torch.empty(numel + pad, dtype=dtype, device=device)
    return flat[pad:].view(shape)


def make_case(m, h, p, fmt, out_dtype, device, gen):
    """Decode-shaped inputs: q at the end of its allocation, W_UK_T views of a kv_b pack."""
    q = tail_view((m, h, p + R), torch.bfloat16, device)
    q.copy_(torch.randn(m, h, p + R, generator=gen).to(device))
    weights = []
    for _ in range(LAYERS):
        pack = (torch.randn(h, p + V, L, generator=gen) * 0.05).to(device)
        if fmt == "mxfp8":
            t = mxfp8.quantize(pack, axis=-1)
            weights.append(MXFP8Weight(t.values[:, :p], t.scales[:, :p]))
        else:
            weights.append(pack.bfloat16()[:, :p])
    out = torch.full((m, h, L + R), float("nan"), device=device).to(out_dtype)
    scale = torch.tensor(0.05, device=device)
    return q, weights, out, scale


def check_case(m, h, p, fmt, out_dtype, device, gen) -> dict:
    """Fused and safe op vs the staged reference on fresh inputs; poisoned outputs."""
    q, weights, out, scale = make_case(m, h, p, fmt, out_dtype, device, gen)
    w = weights[0]
    ref = torch.full_like(out, float("nan"))
    staged_query_projection(q[..., :p], w, q[..., p:], ref, q_scale=scale)
    mla_query_projection(q[..., :p], w, q[..., p:], out, q_scale=scale)
    result = {"written": not out.float().isnan().any().item()}
    if out_dtype == torch.bfloat16:
        diff = (out.float() - ref.float()).abs()
        result["max_abs_diff"] = diff.max().item()
        result["rel_err"] = (diff.norm() / ref.float().norm()).item()
    else:
        codes = out.view(torch.uint8).int() - ref.view(torch.uint8).int()
        result["max_code_diff"] = codes.abs().max().item()
    if fmt == "bf16":
        qn = q[..., :p].transpose(0, 1)
        got = torch.full((h, m, L), float("nan"), dtype=torch.bfloat16, device=device)
        query_bmm.safe_mla_query_bmm(qn, w, got)
        want = torch.bmm(qn.contiguous(), w.contiguous())
        result["safe_rel_err"] = ((got.float() - want.float()).norm() / want.float().norm()).item()
        result["safe_written"] = not got.float().isnan().any().item()
    ok = result["written"] and result.get("safe_written", True)
    # rel_err / safe_rel_err: bf16 both sides, 2 roundings <= 2 * 2**-8 = 7.8e-3 of the norm,
    # fp32 sums of P <= 192 exact bf16 products in other orders ~1e-4 of it: < 1e-2.
    # max_code_diff: e4m3 of bf16 values one ulp apart differ by <= 1 code (e4m3 steps >= bf16
    # ulps); a cancelling near-0 sum (order bound ~1e-4 / q_scale 0.05) could reach 2.
    ok = ok and result.get("rel_err", 0.0) < 1e-2 and result.get("max_code_diff", 0) <= 1
    result["ok"] = ok and result.get("safe_rel_err", 0.0) < 1e-2
    return result


def check_graph_replay(m, h, p, fmt, out_dtype, device, gen) -> dict:
    """Capture fused + safe op once, then replay on fresh inputs copied into the captured
    buffers: every replay must match an eager staged run on those same inputs."""
    q, weights, out, scale = make_case(m, h, p, fmt, out_dtype, device, gen)
    w = weights[0]
    qn, qp_ = q[..., :p], q[..., p:]
    prewarm_query_projection(
        [m], num_heads=h, nope_dim=p, weight_format=fmt, out_dtype=out_dtype, device=device
    )
    latent = torch.empty(h, m, L, dtype=torch.bfloat16, device=device)
    safe = fmt == "bf16"

    def step():
        mla_query_projection(qn, w, qp_, out, q_scale=scale)
        if safe:
            query_bmm.safe_mla_query_bmm(qn.transpose(0, 1), w, latent)

    step()  # eager warm-up (compiles) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    fused_diff = safe_err = 0.0
    for _ in range(3):
        q.copy_(torch.randn(q.shape, generator=gen).to(device))
        out.fill_(float("nan"))
        latent.fill_(float("nan"))
        graph.replay()
        ref = torch.empty_like(out)
        staged_query_projection(qn, w, qp_, ref, q_scale=scale)
        diff = (out.float() - ref.float()).abs().max().item()
        fused_diff = max(fused_diff, float("inf") if diff != diff else diff)  # NaN: unwritten
        if safe:
            want = torch.bmm(qn.transpose(0, 1).contiguous(), w.contiguous()).float()
            err = ((latent.float() - want).norm() / want.norm()).item()
            safe_err = max(safe_err, float("inf") if err != err else err)
    # bf16 outputs |x| < 4: one ulp <= 2**-6 plus the fp32 order bound (P * 2**-23 * sum|q w|
    # ~1e-4) is < 0.02, 0.25 leaves 10x; a stale or wrong replay is off by O(1).
    # safe_err: as check_case's rel_err, 2 bf16 roundings (7.8e-3) + fp32 order.
    ok = fused_diff < 0.25 and safe_err < 1e-2
    return {"fused_max_abs_diff": fused_diff, "safe_rel_err": safe_err, "ok": ok}


def time_case(m, h, p, fmt, out_dtype, device, gen, bandwidth) -> dict:
    q, weights, out, scale = make_case(m, h, p, fmt, out_dtype, device, gen)
    qn, qp_ = q[..., :p], q[..., p:]
    prewarm_query_projection(
        [m], num_heads=h, nope_dim=p, weight_format=fmt, out_dtype=out_dtype, device=device
    )

    # Upstream keeps a BF16 W_UK_T even for an MXFP8 checkpoint: staged reads that.
    staged_weights = [qp_reference.bf16_weight(w).contiguous() for w in weights]

    def staged():
        for w in staged_weights:
            staged_query_projection(qn, w, qp_, out, q_scale=scale)

    def fused():
        for w in weights:
            mla_query_projection(qn, w, qp_, out, q_scale=scale)

    row = {
        "staged_us": common.graph_time_us(staged) / LAYERS,
        "fused_us": common.graph_time_us(fused) / LAYERS,
    }
    if fmt == "bf16":
        qt = qn.transpose(0, 1)
        lat = torch.empty(h, m, L, dtype=torch.bfloat16, device=device)
        q_copy = qt.contiguous()

        def safe():
            for w in weights:
                query_bmm.safe_mla_query_bmm(qt, w, lat)

        def bmm_contiguous():  # the copy is made once, outside: not counted
            for w in weights:
                torch.bmm(q_copy, w, out=lat)

        row["safe_us"] = common.graph_time_us(safe) / LAYERS
        row["bmm_contiguous_us"] = common.graph_time_us(bmm_contiguous) / LAYERS
        row["safe_vs_bmm"] = row["safe_us"] / row["bmm_contiguous_us"]
    w_bytes = h * p * L * (2 if fmt == "bf16" else 1) + (h * p * L // 32 if fmt == "mxfp8" else 0)
    io_bytes = m * h * (p + R) * 2 + m * h * (L + R) * out.element_size()
    row["roofline_us"] = (w_bytes + io_bytes) / bandwidth * 1e6
    row["fused_vs_staged"] = row["staged_us"] / row["fused_us"]
    row["fused_roofline_fraction"] = row["roofline_us"] / row["fused_us"]
    return row


def environment() -> dict:
    return {**common.environment(), "cuda_op": query_bmm.cuda_op_available()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="query_path.json")
    parser.add_argument("--quick", action="store_true", help="M in {1, 16}, H in {11, 16}")
    parser.add_argument("--smoke", action="store_true", help="correctness gate only (CPU ok)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ms, hs = ((1, 16), (11, 16)) if args.quick or args.smoke else (MS, HS)
    grid = list(itertools.product(ms, hs, PS, WEIGHTS, OUTS))
    gen = torch.Generator().manual_seed(0)
    report = {"env": environment(), "layers_per_graph": LAYERS, "checks": [], "timings": []}

    failures = 0
    for m, h, p, fmt, out_dtype in grid:
        gated = can_fuse_query_projection(
            num_heads=h,
            max_m=m,
            nope_dim=p,
            latent_dim=L,
            out_dtype=out_dtype,
            weight_format=fmt,
            device=device,
        )
        check = check_case(m, h, p, fmt, out_dtype, device, gen)
        check.update(m=m, h=h, p=p, weights=fmt, out=str(out_dtype), fused=gated)
        report["checks"].append(check)
        failures += not check["ok"]
    if device.type == "cuda":
        for m, h, p, fmt in [(1, 11, 128, "bf16"), (16, 16, 192, "mxfp8"), (32, 8, 128, "bf16")]:
            replay = check_graph_replay(m, h, p, fmt, torch.bfloat16, device, gen)
            replay.update(m=m, h=h, p=p, weights=fmt, graph_replay=True)
            report["checks"].append(replay)
            failures += not replay["ok"]
            print(f"graph replay M={m} H={h} P={p} {fmt}: {replay}")
    print(f"correctness: {len(report['checks']) - failures}/{len(report['checks'])} cases ok")
    if failures or args.smoke or device.type != "cuda":
        Path(args.out).write_text(json.dumps(report, indent=2))
        return 1 if failures else 0

    bandwidth = common.copy_bandwidth(device)
    report["copy_bandwidth_TBps"] = bandwidth / 1e12
    header = f"{'M':>3} {'H':>3} {'P':>4} {'W':>6} {'out':>5} | {'staged':>7} {'safe':>7} "
    header += f"{'bmm*':>7} {'fused':>7} | {'f/s':>5} {'s/b':>5} {'roof%':>6}"
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; per-layer microseconds, CUDA-graph replay")
    print("f/s = staged/fused speedup; s/b = safe op / bmm on a contiguous query copy")
    print(header)
    for m, h, p, fmt, out_dtype in grid:  # rows and JSON as they come: a timeout keeps them
        row = time_case(m, h, p, fmt, out_dtype, device, gen, bandwidth)
        row.update(m=m, h=h, p=p, weights=fmt, out=str(out_dtype))
        report["timings"].append(row)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(
            f"{m:>3} {h:>3} {p:>4} {fmt:>6} {'e4m3' if out_dtype != torch.bfloat16 else 'bf16':>5}"
            f" | {row['staged_us']:7.2f} {row.get('safe_us', float('nan')):7.2f}"
            f" {row.get('bmm_contiguous_us', float('nan')):7.2f} {row['fused_us']:7.2f}"
            f" | {row['fused_vs_staged']:5.2f} {row.get('safe_vs_bmm', float('nan')):5.2f}"
            f" {100 * row['fused_roofline_fraction']:6.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
