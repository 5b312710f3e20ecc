"""DeepSeek-V4's Triton attention, record writer and compressor (``vllm_mla.ops.dsv4``)
against the torch reference, at V4's decode and prefill shapes, plus CUDA-graph replay and a decode
timing against the HBM roofline. ``essential.py dsv4`` runs it on the GPU; on CPU the
same checks run at tiny shapes in Triton's interpreter (no figure is a GPU result).

    python benchmarks/dsv4_attention.py [--dry]

Shapes: a 128-token window (block size 64) plus, for a C4 layer, the indexer's top 512 of
a 4:1 compressed cache, or for a C128 layer every entry of a 128:1 one (block size 64);
heads 16 and 64 (one and four tiles of 16); decode T 32, prefill T 1024 (each token its own window
and entries). Error model (``P_ROUNDING``): the kernel rounds each probability to bf16
before the PV dot, as vLLM's kernels do, so each output moves by at most 2**-8 of the
largest value its token attends to; the record decode is exact and the fp32 sums add
orders less. The writer is bit-exact (0 bytes may differ from ``record.write``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--dry" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from vllm_mla.formats import DSV4_RECORD
from vllm_mla.ops.dsv4 import dispatch, record

WINDOW, TOPK, BLOCK = 128, 512, 64
P_ROUNDING = 2.0**-8
MODEL = "each probability rounded to bf16 (2**-8 of the largest attended value)"
# (name, T, H, window slots, compressed slots): GPU shapes, then the dry run's
SHAPES = [
    ("decode C4", 32, 64, WINDOW, TOPK),
    ("decode C4", 32, 16, WINDOW, TOPK),
    ("decode C128", 32, 64, WINDOW, 64),
    ("prefill C4", 1024, 64, WINDOW, TOPK),
]
DRY_SHAPES = [("decode C4", 3, 20, 40, 24), ("prefill C128", 5, 3, 40, 6)]


class Case:
    """Paged caches written by the Triton writer, queries, slots (-1 sprinkled) and sinks."""

    def __init__(self, t, h, n_window, n_comp, device, gen, pages=None):
        self.t, self.h, self.device = t, h, device
        pages = pages or max(4, (t + n_window) // BLOCK + 2)
        self.window = torch.zeros(pages, BLOCK * DSV4_RECORD, dtype=torch.uint8, device=device)
        self.comp = torch.zeros(pages, BLOCK * DSV4_RECORD, dtype=torch.uint8, device=device)
        self.rows = pages * BLOCK
        self.w_slots = torch.empty(t, n_window, dtype=torch.int32, device=device)
        self.c_slots = torch.empty(t, n_comp, dtype=torch.int32, device=device)
        self.q = torch.empty(t, h, 512, dtype=torch.bfloat16, device=device)
        self.sink = torch.empty(h, dtype=torch.float32, device=device)
        self.out = torch.empty(t, h, 512, dtype=torch.float32, device=device)
        self.new_rows = torch.empty(t, 512, dtype=torch.bfloat16, device=device)
        self.new_slots = torch.empty(t, dtype=torch.int64, device=device)
        self.scale = 512**-0.5
        self.refill(gen)

    def refill(self, gen) -> None:
        """Fresh values in every buffer, in place (graph replays read the same addresses)."""

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(self.device)

        def slots(n):
            s = torch.randint(0, self.rows, (self.t, n), generator=gen)
            return s.masked_fill(torch.rand(self.t, n, generator=gen) < 0.05, -1)

        for cache in (self.window, self.comp):
            dispatch.write(cache, randn(self.rows, 512), torch.arange(self.rows), BLOCK)
        self.w_slots.copy_(slots(self.w_slots.shape[1]))
        self.c_slots.copy_(slots(self.c_slots.shape[1]))
        self.q.copy_(randn(self.t, self.h, 512, scale=0.5))
        self.sink.copy_(randn(self.h, scale=2.0) + 2.0)  # weighs a few % of 640 rows
        self.new_rows.copy_(randn(self.t, 512, scale=3.0))
        self.new_slots.copy_(torch.randperm(self.rows, generator=gen)[: self.t])

    def step(self) -> None:
        """What a layer does each step: store this step's rows, then attend (Triton)."""
        dispatch.write(self.window, self.new_rows, self.new_slots, BLOCK, impl="triton")
        dispatch.attend(
            self.q, self.window, self.w_slots, BLOCK, self.comp, self.c_slots, BLOCK,
            self.sink, self.scale, out=self.out, impl="triton",
        )  # fmt: skip

    def compare(self, before: torch.Tensor) -> dict:
        """``out`` and the window cache after ``step`` against the reference run on
        ``before`` (the window cache as it was)."""
        expect = before.clone()
        record.write(expect, self.new_rows, self.new_slots, BLOCK)
        ref = dispatch.attend(
            self.q, expect, self.w_slots, BLOCK, self.comp, self.c_slots, BLOCK, self.sink,
            self.scale, impl="reference",
        )  # fmt: skip
        attended = (
            torch.cat(
                [
                    record.read(expect, self.w_slots, BLOCK),
                    record.read(self.comp, self.c_slots, BLOCK),
                ],
                dim=1,
            )
            .abs()
            .amax(dim=(1, 2))
        )
        ratio = ((self.out - ref).abs().amax(dim=(1, 2)) / (P_ROUNDING * attended + 1e-6)).max()
        bytes_off = int((expect != self.window).sum())
        return {"worst_over_bound": float(ratio), "writer_bytes_off": bytes_off}


def check(name, t, h, n_window, n_comp, device, gen) -> dict:
    """One eager step against the reference: ``value`` is the worst error over its bound
    (``ok`` <= 1), the writer's differing bytes must be 0."""
    case = Case(t, h, n_window, n_comp, device, gen)
    before = case.window.clone()
    case.step()
    res = case.compare(before)
    return {
        **res,
        "metric": "worst error / bound",
        "value": res["worst_over_bound"],
        "bound": 1.0,
        "model": MODEL + "; writer bit-exact",
        "ok": res["worst_over_bound"] <= 1.0 and res["writer_bytes_off"] == 0,
    }


# (ratio, coff, D): C4 and C128 main entries, C4 indexer keys
COMPRESSORS = [(4, 2, 512), (128, 1, 512), (4, 2, 128)]
COMPRESS_REL = 1e-5  # fp32 in another order than torch's: a few roundings of the row's max


def compress_check(ratio, coff, width, t, device, gen) -> dict:
    """``t`` window-ending tokens' entries (compress, norm, RoPE) against the reference:
    ``value`` is the worst error over ``COMPRESS_REL`` times the row's largest value."""
    state = torch.randn(64, 64, 2 * coff * width, generator=gen).to(device)
    gather = torch.randint(0, 64 * 64, (t, coff * ratio), generator=gen, dtype=torch.int32)
    gather[0, : ratio * (coff - 1) + 1] = -1  # a sequence's first window: rows before it
    positions = torch.randint(0, 8192, (t,), generator=gen)
    weight = torch.rand(width, generator=gen) + 0.5
    cos_sin = torch.randn(8192, 64, generator=gen)
    args = [x.to(device) for x in (gather, positions, weight)]
    args = (state, *args, 1e-6, cos_sin.to(device), ratio)
    ref = dispatch.compressed_rows(*args, impl="reference")
    out = dispatch.compressed_rows(*args, impl="triton")
    worst = ((out - ref).abs().amax(-1) / (COMPRESS_REL * ref.abs().amax(-1))).max()
    return {
        "metric": "worst error / bound",
        "value": float(worst),
        "bound": 1.0,
        "model": "fp32 sums in another order (1e-5 of the row's largest value)",
        "ok": float(worst) <= 1.0,
    }


def graph_check(capture, device, gen, t=32, h=64, rounds=3) -> dict:
    """Writer + attention captured once (``capture(step, device)`` gives a replay), replayed
    on fresh caches, queries, slots and sinks copied into the captured buffers: each replay
    within the bound, writer bytes exact."""
    case = Case(t, h, WINDOW, TOPK, device, gen)
    replay = capture(case.step, device)
    worst, off = 0.0, 0
    for _ in range(rounds):
        case.refill(gen)
        before = case.window.clone()
        case.out.fill_(float("nan"))
        replay()
        res = case.compare(before)
        worst, off = max(worst, res["worst_over_bound"]), off + res["writer_bytes_off"]
    return {
        "metric": "worst error / bound",
        "value": worst,
        "bound": 1.0,
        "writer_bytes_off": off,
        "model": MODEL + "; writer bit-exact; no compile after capture",
        "ok": worst <= 1.0 and off == 0,
    }


def time_decode(device, gen, bandwidth, t=32, h=64) -> dict:
    """Graph-replayed decode attention (C4: 128 + 512 records a token) against the HBM
    roofline of its gathered records (read once per head tile)."""
    import common

    from vllm_mla.ops.dsv4 import triton_kernels as k

    case = Case(t, h, WINDOW, TOPK, device, gen, pages=4096)

    def attend():
        dispatch.attend(
            case.q, case.window, case.w_slots, BLOCK, case.comp, case.c_slots, BLOCK,
            case.sink, case.scale, out=case.out, impl="triton",
        )  # fmt: skip

    us = common.graph_time_us(attend, reps=50)
    tiles = -(-h // k.block_h(h))
    gathered = t * (WINDOW + TOPK) * DSV4_RECORD * tiles
    roof_us = gathered / bandwidth * 1e6
    return {
        "shape": f"T{t} H{h} window {WINDOW} + top-{TOPK}",
        "ours_us": us,
        "base_us": roof_us,
        "base": "HBM roofline (T x 640 records x head tiles)",
        "ratio": us / roof_us,
        "ok": True,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU, interpreter, tiny shapes")
    args = parser.parse_args()
    dry = args.dry or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    gen = torch.Generator().manual_seed(0)
    rows = [
        {"name": name, **check(name, *shape, device, gen)}
        for name, *shape in (DRY_SHAPES if dry else SHAPES)
    ]
    for ratio, coff, width in COMPRESSORS:
        check_row = compress_check(ratio, coff, width, 3 if dry else 1024, device, gen)
        rows.append({"name": f"compressor ratio {ratio} D {width}", **check_row})
    print(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
