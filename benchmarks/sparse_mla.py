"""Sparse MLA (Triton split-K) at GLM-5 TP4 shapes: correctness, CUDA graphs, soak, speed.

1. Correctness gate: Triton vs ``sparse_mla_reference`` for decode T in {1, 8, 32, 64}
   (ragged ``lengths`` and -1 padding) and extend T=4096, H in {16, 64}, top-k 2048,
   every KV format (bf16, fp8_ds_mla, nvfp4_ds_mla), block size 64, a cache of
   ``--blocks`` blocks whose pages interleave with another layer's (dim-0 stride = two
   pages).
2. CUDA graphs: prewarm, capture one decode call (T=32, H=16), replay on fresh q /
   indices / lengths copied into the captured buffers; each replay must match.
3. Soak: ``--soak`` replays (default 10,000) cycling through a bank of input sets, each
   output checked on the device against the bank's reference (NaN or error > tolerance
   counts as an error); one sync at the end.
4. Decode context parallelism (DCP): per rank, the prepared and frozen decode-step call
   (``BoundCall``, B12X_MLA_SPARSE's) with its DCP shard and an lse buffer: the logical
   top-k (request positions of the group) mapped and filtered in the Triton kernel,
   captured in a CUDA graph and replayed on fresh q / top-k; each rank against its
   reference, vLLM's LSE merge of the ranks against DCP 1's reference; no compile after
   capture. N=2 (interleave 1; both formats) and N=4 (interleave 64; fp8_ds_mla), H = N x 16
   gathered heads, K=2048.
5. Decode speed: median CUDA-graph replay time (CUDA events) at T=32, K=2048, H=16 (and
   a few other shapes). Gathered bytes = T * K * record_bytes (every index counted, so
   rows shared by two tokens count twice; the unique-row figure is printed too), over
   the bandwidth of a 1 GiB device-to-device copy measured in the same run -> % roofline.

    python benchmarks/sparse_mla.py --out $OUT/sparse_mla.json   # GPU, < 4 min on an H200
    python benchmarks/sparse_mla.py --smoke --out /tmp/s.json     # CPU, Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import copy_bandwidth, environment

from vllm_mla.formats import HEAD_DIM
from vllm_mla.ops import sparse_mla as sm
from vllm_mla.ops.dcp import DCPShard, lse_merge
from vllm_mla.ops.sparse_mla import (
    KV_FORMATS,
    LSE_ABS_ERR,
    OUT_REL_ERR,
    PreparationSession,
    SparseMLACaps,
    logical_to_physical,
    nvfp4_record,
    pack_rows,
    record_bytes,
    scratch_bytes,
    sparse_mla_forward,
    sparse_mla_reference,
    write_records,
)
from vllm_mla.ops.sparse_mla import triton_kernels as kernels
from vllm_mla.ops.sparse_mla.formats import FORMAT

SCALE = 1 / math.sqrt(192 + 64)  # GLM-5: qk_nope 192 + rope 64
FLASH_SCALE = 1 / math.sqrt(256)  # GLM-5.3-Flash: qk_nope 256, no RoPE
# GLM-5.3-Flash's sparse decode: 64 heads (8 per rank at TP 8, 16 at TP 4), latent 512
# without RoPE, top-k 2048 pools' tokens plus a 15-token tail in a 2176-wide buffer
# (round_up(2048 + 16 - 1, 128); its unused tail slots are -1)
FLASH_HEADS, FLASH_TOPK_WIDTH = (8, 16), 2176


def make_cache(fmt, num_blocks, block_size, device, gen, rope=64):
    """Packed random rows; pages interleave with a NaN-filled neighbour (stride = 2 pages).
    ``rope`` 0: GLM-5.3-Flash's records (fixed-width records keep their bytes, the RoPE slot
    filled with NaN bytes as a page vLLM never wrote there would hold; bf16 512 wide)."""
    n = num_blocks * block_size
    kv_c = torch.randn(n, 512, generator=gen, device=device)
    k_pe = torch.randn(n, rope, generator=gen, device=device)
    packed = pack_rows(kv_c, k_pe, fmt)
    big = torch.empty(
        (num_blocks, 2, block_size, packed.shape[1]), dtype=packed.dtype, device=device
    )
    big.view(torch.uint8).fill_(0xFF)  # NaN in every format (nvfp4: its scales)
    slot = FORMAT[fmt].rope_slot
    if slot is not None and rope == 0:  # the unread slot: a stray read turns into NaN
        packed[:, slot[0] : slot[1]] = 0xFF
    big[:, 0] = packed.view(num_blocks, block_size, -1)
    return big[:, 0]


def make_inputs(t, h, k, num_rows, device, gen, *, ragged, empty=0.05, rope=64):
    """q [T, H, 512 + rope] bf16; per token K distinct rows, a fraction ``empty`` of them
    -1; optional ragged lengths."""
    q = torch.randn(t, h, HEAD_DIM - 64 + rope, generator=gen, device=device).bfloat16()
    keys = torch.rand(t, num_rows, generator=gen, device=device)
    idx = keys.topk(k, dim=1).indices.int()  # distinct rows per token
    idx[torch.rand(t, k, generator=gen, device=device) < empty] = -1
    lengths = None
    if ragged:
        lengths = torch.randint(0, k + 1, (t,), generator=gen, device=device, dtype=torch.int32)
        lengths[0] = k
    return q, idx, lengths


def errors(out, lse, ref, ref_lse) -> dict:
    out, ref = out.float(), ref.float()
    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    same_empty = torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    nan = bool(out.isnan().any() or lse.isnan().any())
    ok = (not nan) and same_empty and rel < OUT_REL_ERR and lse_err < LSE_ABS_ERR
    return {"rel_err": rel, "lse_err": lse_err, "nan": nan, "ok": ok}


def check(fmt, t, h, k, cache, device, gen, impl, rope=64) -> dict:
    num_rows = cache.shape[0] * cache.shape[1]
    q, idx, lengths = make_inputs(t, h, k, num_rows, device, gen, ragged=t <= 64, rope=rope)
    out = torch.full((t, h, 512), float("nan"), device=device).bfloat16()
    lse = torch.full((t, h), float("nan"), device=device)
    scale = SCALE if rope else FLASH_SCALE
    sparse_mla_forward(
        q, cache, idx, scale, kv_format=fmt, lengths=lengths, out=out, lse=lse, impl=impl
    )
    ref, ref_lse = sparse_mla_reference(q, cache, idx, scale, kv_format=fmt, lengths=lengths)
    return {"fmt": fmt, "T": t, "H": h, "K": k, "rope": rope, **errors(out, lse, ref, ref_lse)}


class Static:
    """Captured buffers for one decode shape: inputs, outputs, scratch."""

    def __init__(self, fmt, t, h, k, cache, device):
        self.fmt, self.cache = fmt, cache
        self.q = torch.zeros(t, h, HEAD_DIM, dtype=torch.bfloat16, device=device)
        self.idx = torch.full((t, k), -1, dtype=torch.int32, device=device)
        self.lengths = torch.full((t,), k, dtype=torch.int32, device=device)
        self.out = torch.empty(t, h, 512, dtype=torch.bfloat16, device=device)
        self.lse = torch.empty(t, h, device=device)
        self.scratch = torch.empty(
            max(16, scratch_bytes(t, h, k, kv_format=fmt)), dtype=torch.uint8, device=device
        )

    def step(self):
        sparse_mla_forward(
            self.q,
            self.cache,
            self.idx,
            SCALE,
            kv_format=self.fmt,
            lengths=self.lengths,
            out=self.out,
            lse=self.lse,
            scratch=self.scratch,
            impl="triton",
        )

    def load(self, q, idx, lengths):
        self.q.copy_(q)
        self.idx.copy_(idx)
        self.lengths.copy_(
            lengths if lengths is not None else torch.full_like(self.lengths, idx.shape[1])
        )

    def capture(self) -> torch.cuda.CUDAGraph:
        sm.prewarm(
            self.cache,
            num_heads=self.q.shape[1],
            topk=self.idx.shape[1],
            kv_format=self.fmt,
            token_counts=[self.q.shape[0]],
            with_lengths=True,
            return_lse=True,
            impl="triton",
        )
        self.step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        return graph


def graph_replay_check(fmt, cache, device, gen, t=32, h=16, k=2048, rounds=4) -> dict:
    st = Static(fmt, t, h, k, cache, device)
    graph = st.capture()
    frozen = sm.compiled_variants()
    worst = {"rel_err": 0.0, "lse_err": 0.0, "nan": False, "ok": True}
    num_rows = cache.shape[0] * cache.shape[1]
    for _ in range(rounds):
        q, idx, lengths = make_inputs(t, h, k, num_rows, device, gen, ragged=True)
        st.load(q, idx, lengths)
        st.out.fill_(float("nan"))
        graph.replay()
        ref, ref_lse = sparse_mla_reference(q, cache, idx, SCALE, kv_format=fmt, lengths=lengths)
        e = errors(st.out, st.lse, ref, ref_lse)
        worst = {
            "rel_err": max(worst["rel_err"], e["rel_err"]),
            "lse_err": max(worst["lse_err"], e["lse_err"]),
            "nan": worst["nan"] or e["nan"],
            "ok": worst["ok"] and e["ok"],
        }
    worst["no_compile_after_capture"] = sm.compiled_variants() == frozen
    worst["ok"] = worst["ok"] and worst["no_compile_after_capture"]
    return {"fmt": fmt, "T": t, "H": h, "K": k, "rounds": rounds, **worst}


def writer_check(device, gen, t=32, blocks=16, block_size=64, rounds=3, graph=True) -> dict:
    """The nvfp4_ds_mla cache writer (Triton) on fresh latents and slots each round (random,
    saturating, zero and -0 rows; one slot -1), captured once in a CUDA graph and replayed
    (``graph``; eager otherwise): every record byte-identical to ``nvfp4_record.encode``,
    every other byte of the cache untouched."""
    fmt = "nvfp4_ds_mla"
    cache = torch.empty(blocks, block_size, nvfp4_record.RECORD, dtype=torch.uint8, device=device)
    kv_c = torch.empty(t, 512, dtype=torch.bfloat16, device=device)
    k_pe = torch.empty(t, 1, 64, dtype=torch.bfloat16, device=device)
    slots = torch.empty(t, dtype=torch.int64, device=device)

    def load() -> None:
        kv_c.copy_(torch.randn(t, 512, generator=gen, device=device) * 3)
        kv_c[0] *= 2000  # past 448 * 6: the scale saturates
        kv_c[1] = 0
        kv_c[2] = -0.0
        k_pe.copy_(torch.randn(t, 1, 64, generator=gen, device=device) * 100)
        slots.copy_(torch.randperm(blocks * block_size, generator=gen, device=device)[:t])
        slots[3] = -1

    def write() -> None:
        write_records(kv_c, k_pe, cache, slots, fmt, impl="triton")

    load()
    write()  # compiles the variant before any capture
    replay = write
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            write()
        replay = g.replay
    mismatched = 0
    for _ in range(rounds):
        load()
        cache.fill_(0xA5)
        replay()
        want = torch.full_like(cache, 0xA5).view(-1, nvfp4_record.RECORD)
        keep = slots >= 0
        want[slots[keep]] = nvfp4_record.encode(kv_c[keep].float(), k_pe[keep, 0].float())
        mismatched += int((cache.view_as(want) != want).sum())
    return {
        "fmt": fmt,
        "T": t,
        "rounds": rounds,
        "graph": graph,
        "mismatched_bytes": mismatched,
        "ok": mismatched == 0,
    }


def soak(fmt, cache, device, gen, replays, t=32, h=16, k=2048, bank=8) -> dict:
    """``replays`` graph replays on inputs cycling through ``bank`` sets; errors counted on
    the device (NaN anywhere, or a relative error above OUT_REL_ERR)."""
    st = Static(fmt, t, h, k, cache, device)
    graph = st.capture()
    num_rows = cache.shape[0] * cache.shape[1]
    sets, refs = [], []
    for _ in range(bank):
        q, idx, lengths = make_inputs(t, h, k, num_rows, device, gen, ragged=True)
        sets.append((q, idx, lengths))
        refs.append(sparse_mla_reference(q, cache, idx, SCALE, kv_format=fmt, lengths=lengths)[0])
    ref_norms = [r.float().norm().clamp_min(1e-30) for r in refs]
    errs = torch.zeros((), dtype=torch.int64, device=device)
    start = time.perf_counter()
    for i in range(replays):
        j = i % bank
        st.load(*sets[j])
        graph.replay()
        out = st.out.float()
        bad = out.isnan().any() | ((out - refs[j].float()).norm() / ref_norms[j] > OUT_REL_ERR)
        errs += bad.long()
    torch.cuda.synchronize()
    count = int(errs.item())
    return {
        "fmt": fmt,
        "T": t,
        "H": h,
        "K": k,
        "replays": replays,
        "errors": count,
        "seconds": time.perf_counter() - start,
        "ok": count == 0,
    }


# ---------------------------------------------------------------- decode context parallelism
# (N ranks, interleave, gathered heads H, request lengths, page rows) on a GPU / in the smoke
DCP_GPU = (
    dict(n=2, interleave=1, h=32, lengths=(4096, 6000, 2500, 8192), block_size=64),
    dict(n=4, interleave=64, h=64, lengths=(4096, 6000, 2500, 8192), block_size=64),
    # the seeds' TP 4 / DCP 4 / MTP 3: runs of 4 tokens per request (8 requests at T 32)
    dict(n=4, interleave=1, h=64, lengths=(4096, 6000, 2500, 8192), block_size=64, next_n=4),
)
DCP_SMOKE = (
    dict(n=2, interleave=1, h=3, lengths=(100, 64), block_size=16),
    dict(n=3, interleave=4, h=3, lengths=(100, 64), block_size=16, next_n=4),
)


def _place(rows_of, block_size, device, gen):
    """(cache, block table int32 [R, W]): each request's rows at local positions 0..n-1,
    on shuffled pages (plus one spare)."""
    pages = [-(-r.shape[0] // block_size) for r in rows_of]
    order = torch.randperm(sum(pages) + 1, generator=gen, device=device).int()
    width, dtype = rows_of[0].shape[1], rows_of[0].dtype
    cache = torch.zeros(sum(pages) + 1, block_size, width, dtype=dtype, device=device)
    table = torch.zeros(len(rows_of), max(pages), dtype=torch.int32, device=device)
    used = 0
    for req, rows in enumerate(rows_of):
        table[req, : pages[req]] = order[used : used + pages[req]]
        used += pages[req]
        req_id = torch.tensor([req], dtype=torch.int32, device=device)
        positions = torch.arange(rows.shape[0], dtype=torch.int32, device=device)[None]
        physical = logical_to_physical(req_id, table, positions, block_size)[0].long()
        cache.view(-1, width)[physical] = rows
    return cache, table


class DCPSet:
    """One KV set (a request per entry of ``lengths``) whole (DCP 1) and sharded over ``n``
    ranks as vLLM's slot mapping shards it (``DCPShard``: runs of ``interleave`` positions
    round robin), each layout with its own shuffled pages and block table."""

    def __init__(self, fmt, n, interleave, lengths, block_size, device, gen):
        self.fmt, self.lengths, self.device = fmt, lengths, device
        self.rows = [
            pack_rows(
                torch.randn(length, 512, generator=gen, device=device),
                torch.randn(length, 64, generator=gen, device=device),
                fmt,
            )
            for length in lengths
        ]
        self.whole = _place(self.rows, block_size, device, gen)
        self.ranks = []
        for r in range(n):
            shard = DCPShard(n, r, interleave)
            local = [
                rows[shard.to_local(torch.arange(rows.shape[0], device=device)) >= 0]
                for rows in self.rows
            ]
            self.ranks.append((shard, *_place(local, block_size, device, gen)))

    def selection(self, t, k, gen, empty=0.05, next_n=1):
        """(logical top-k int32 [t, k]: distinct request positions, a fraction ``empty`` -1;
        req_id int32 [t]). ``next_n`` 1: token i belongs to request i % R and sees all of
        it; > 1 (speculative decoding, MTP next_n - 1 drafts): runs of ``next_n`` tokens per
        request, token j of a run sees ``length - next_n + j + 1`` positions (causal), the
        decode batch vLLM flattens per token under DCP."""
        token = torch.arange(t, device=self.device)
        req = (token // next_n) % len(self.lengths)
        idx = torch.full((t, k), -1, dtype=torch.int32, device=self.device)
        for i in range(t):
            length = self.lengths[int(req[i])] - next_n + 1 + i % next_n
            keys = torch.rand(length, generator=gen, device=self.device)
            idx[i] = keys.topk(min(k, length)).indices.int()
        idx[torch.rand(t, k, generator=gen, device=self.device) < empty] = -1
        return idx, req.int()


def dcp_check(
    fmt,
    device,
    gen,
    *,
    n,
    interleave,
    h,
    lengths,
    block_size,
    t=32,
    k=2048,
    graph=True,
    rounds=3,
    next_n=1,
) -> dict:
    """DCP through the decode-step call (module docstring, item 4): per rank a prepared,
    frozen ``BoundCall`` with the rank's ``DCPShard``, launched on the logical top-k with
    the rank's block table and an lse buffer (with ``graph``: captured once, replayed on
    fresh inputs copied into the captured buffers). Worst errors over ``rounds``: each
    rank against ``sparse_mla_reference`` on the physical rows it holds, and the LSE merge
    of the ranks against DCP 1's reference, both within OUT_REL_ERR / LSE_ABS_ERR.
    ``next_n`` > 1: MTP decode batches (``DCPSet.selection``)."""
    kv = DCPSet(fmt, n, interleave, lengths, block_size, device, gen)
    caps = SparseMLACaps(
        max_tokens=t,
        num_heads=h,
        topk=k,
        kv_format=fmt,
        return_lse=True,
        dcp=True,
        token_buckets=(t,),
    )
    ranks = []
    for shard, cache, table in kv.ranks:
        session = PreparationSession(device)
        plan = session.plan(caps, impl="triton")
        session.prepare(plan)
        session.freeze()  # from here an unprepared variant raises instead of compiling
        st = Static(fmt, t, h, k, cache, device)
        st.req = torch.zeros(t, dtype=torch.int32, device=device)
        call = session.bound_call(
            plan, softmax_scale=SCALE, buffers=lambda _t, st=st: (st.scratch, st.out), dcp=shard
        )

        def step(st=st, call=call, cache=cache, table=table):
            call.run(st.q[..., :512], st.q[..., 512:], cache, st.idx, st.req, table, lse=st.lse)

        step()  # validates the call once, outside capture
        runner = step
        if graph:
            torch.cuda.synchronize()
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                step()
            runner = captured.replay
        ranks.append((shard, cache, table, st, runner))
    frozen = sm.compiled_variants()
    worst = {"rel_err": 0.0, "lse_err": 0.0, "nan": False, "ok": True}
    rank_worst = dict(worst)
    for _ in range(rounds):
        q = torch.randn(t, h, HEAD_DIM, generator=gen, device=device).bfloat16()
        idx, req = kv.selection(t, k, gen, next_n=next_n)
        outs, lses = [], []
        for shard, cache, table, st, runner in ranks:
            st.q.copy_(q)
            st.idx.copy_(idx)
            st.req.copy_(req)
            st.out.fill_(float("nan"))
            st.lse.fill_(float("nan"))
            runner()
            phys = logical_to_physical(req, table, idx, block_size, shard=shard)
            ref, ref_lse = sparse_mla_reference(q, cache, phys, SCALE, kv_format=fmt)
            rank_worst = _worse(rank_worst, errors(st.out, st.lse, ref, ref_lse))
            outs.append(st.out.float())
            lses.append(st.lse.clone())
        cache1, table1 = kv.whole
        whole = logical_to_physical(req, table1, idx, block_size)
        ref, ref_lse = sparse_mla_reference(q, cache1, whole, SCALE, kv_format=fmt)
        merged, merged_lse = lse_merge(torch.stack(outs), torch.stack(lses))
        worst = _worse(worst, errors(merged, merged_lse, ref, ref_lse))
    no_compile = sm.compiled_variants() == frozen
    return {
        "kind": f"dcp{' graph' if graph else ''} N={n} I={interleave} next_n={next_n}",
        "fmt": fmt,
        "T": t,
        "H": h,
        "K": k,
        "N": n,
        "interleave": interleave,
        "next_n": next_n,
        "rounds": rounds,
        **worst,
        "rank_rel_err": rank_worst["rel_err"],
        "rank_lse_err": rank_worst["lse_err"],
        "no_compile_after_capture": no_compile,
        "ok": worst["ok"] and rank_worst["ok"] and no_compile,
    }


def _worse(a: dict, b: dict) -> dict:
    return {
        "rel_err": max(a["rel_err"], b["rel_err"]),
        "lse_err": max(a["lse_err"], b["lse_err"]),
        "nan": a["nan"] or b["nan"],
        "ok": a["ok"] and b["ok"],
    }


def time_decode(fmt, t, h, k, cache, device, gen, bandwidth, reps=50) -> dict:
    st = Static(fmt, t, h, k, cache, device)
    num_rows = cache.shape[0] * cache.shape[1]
    q, idx, _ = make_inputs(t, h, k, num_rows, device, gen, ragged=False, empty=0.0)
    st.load(q, idx, None)
    graph = st.capture()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    us = sorted(times)[len(times) // 2]
    gathered = t * k * record_bytes(fmt)
    loaded = t * kernels.gathered_bytes(h, k, fmt)
    unique = int(torch.unique(st.idx).numel()) * record_bytes(fmt)
    return {
        "fmt": fmt,
        "T": t,
        "H": h,
        "K": k,
        "us": us,
        "gathered_bytes": gathered,
        "loaded_bytes": loaded,  # the kernel's own accounting: once per head tile
        "unique_bytes": unique,
        "GBps": gathered / (us * 1e-6) / 1e9,
        "pct_roofline": 100 * gathered / (us * 1e-6) / bandwidth,
    }


def kv_reads(topk: int = 2048) -> list[dict]:
    """The split kernel's own byte accounting per token (shapes only, any device): KV
    bytes it loads vs the K records a token selects, now and with the old 16-head tiles."""
    rows = []
    for fmt in KV_FORMATS:
        for h in (16, 32, 64, 128):
            need = topk * record_bytes(fmt)
            loads = kernels.gathered_bytes(h, topk, fmt)
            rows.append(
                {
                    "fmt": fmt,
                    "H": h,
                    "K": topk,
                    "heads_per_program": kernels.block_h(h),
                    "selected_bytes": need,
                    "loaded_bytes": loads,
                    "reads_per_row": loads / need,
                    "reads_per_row_16_head_tiles": -(-h // 16),
                }
            )
    return rows


def markdown(report: dict) -> str:
    lines = [f"# Sparse MLA ({report['env'].get('gpu', 'CPU smoke')})", ""]
    lines += [
        "KV bytes the split kernel loads per token (its own accounting; K x record = "
        "what a token selects):",
        "",
        "| fmt | H | K | heads/program | K x record | loaded | reads/row | with 16-head tiles |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report.get("kv_reads", []):
        lines.append(
            f"| {r['fmt']} | {r['H']} | {r['K']} | {r['heads_per_program']} | "
            f"{r['selected_bytes']:,} | {r['loaded_bytes']:,} | {r['reads_per_row']:g} | "
            f"{r['reads_per_row_16_head_tiles']} |"
        )
    lines.append("")
    lines += [
        "| check | fmt | T | H | K | rel err | lse err | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in report["checks"]:
        lines.append(
            f"| {c.get('kind', 'eager')} | {c['fmt']} | {c['T']} | {c['H']} | {c['K']} | "
            f"{c['rel_err']:.2e} | {c['lse_err']:.2e} | {c['ok']} |"
        )
    for w in report.get("writer", []):
        how = "graph replay" if w["graph"] else "eager"
        lines += [
            "",
            f"nvfp4_ds_mla writer ({how}, {w['rounds']} rounds x T {w['T']}): "
            f"{w['mismatched_bytes']} bytes differ from the torch encoder",
        ]
    if report.get("soak"):
        lines += ["", "| soak | fmt | replays | errors |", "|---|---|---|---|"]
        for s in report["soak"]:
            lines.append(f"| graph | {s['fmt']} | {s['replays']} | {s['errors']} |")
    if report.get("timing"):
        bw = report["copy_bandwidth_GBps"]
        lines += ["", f"Copy bandwidth {bw:.0f} GB/s; bytes = T*K*record (all indices).", ""]
        lines += ["| fmt | T | H | K | us | GB/s | % roofline |", "|---|---|---|---|---|---|---|"]
        for r in report["timing"]:
            lines.append(
                f"| {r['fmt']} | {r['T']} | {r['H']} | {r['K']} | {r['us']:.1f} | "
                f"{r['GBps']:.0f} | {r['pct_roofline']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (markdown beside it)")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny correctness gate only")
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--soak", type=int, default=10_000)
    args = parser.parse_args()
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(gen_device)
    gen = torch.Generator(device=device).manual_seed(0)
    report = {"env": environment(), "checks": [], "soak": [], "timing": []}
    report["kv_reads"] = kv_reads()
    started = time.perf_counter()

    if args.smoke:
        impl = "triton"
        for fmt in KV_FORMATS:
            cache = make_cache(fmt, 8, 16, device, gen)
            for t, h in ((1, 3), (3, 16)):
                report["checks"].append(check(fmt, t, h, 40, cache, device, gen, impl))
            # the DCP path, eager (no graphs without a GPU): one shard layout per format
            shape = DCP_SMOKE[KV_FORMATS.index(fmt) % len(DCP_SMOKE)]
            report["checks"].append(
                dcp_check(fmt, device, gen, t=8, k=40, graph=False, rounds=1, **shape)
            )
        report["writer"] = [
            writer_check(device, gen, t=8, blocks=2, block_size=16, rounds=1, graph=False)
        ]
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke", file=sys.stderr)
            return 2
        bw = copy_bandwidth(device)
        report["copy_bandwidth_GBps"] = bw / 1e9
        for fmt in KV_FORMATS:
            cache = make_cache(fmt, args.blocks, 64, device, gen)
            for h in (16, 64):
                for t in (1, 8, 32, 64, 4096):
                    report["checks"].append(check(fmt, t, h, 2048, cache, device, gen, "triton"))
                    print(report["checks"][-1], flush=True)
            g = graph_replay_check(fmt, cache, device, gen)
            report["checks"].append({"kind": "graph", **g})
            print(report["checks"][-1], flush=True)
            if FORMAT[fmt].reader == "nvfp4":  # its writer is ours too (Triton)
                report["writer"] = [writer_check(device, gen)]
                print(report["writer"][-1], flush=True)
            for shape in DCP_GPU if fmt == "fp8_ds_mla" else DCP_GPU[:1]:
                report["checks"].append(dcp_check(fmt, device, gen, **shape))
                print(report["checks"][-1], flush=True)
            for t, h in ((32, 16), (1, 16), (64, 16), (32, 64)):
                report["timing"].append(time_decode(fmt, t, h, 2048, cache, device, gen, bw))
                print(report["timing"][-1], flush=True)
            if fmt == "fp8_ds_mla":
                report["soak"].append(soak(fmt, cache, device, gen, args.soak))
                print(report["soak"][-1], flush=True)
            del cache
            torch.cuda.empty_cache()
    report["seconds"] = time.perf_counter() - started
    ok = all(c["ok"] for c in report["checks"]) and all(s["ok"] for s in report["soak"])
    ok = ok and all(w["ok"] for w in report.get("writer", []))
    report["ok"] = ok
    text = markdown(report)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        args.out.with_suffix(".md").write_text(text)
    print("PASS" if ok else "FAIL", f"({report['seconds']:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
