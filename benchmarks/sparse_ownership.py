"""Sparse-MLA ownership on the device: allocator census, KV-pool rebind, graph replay.

Evidence for issue 6 that ``benchmarks/sparse_mla.py`` does not give (that script
covers kernel correctness, raw-op graph replay, the soak and the roofline). Per case
(KV format x heads, GLM-5 TP4 shapes: top-k 2048, head 576, block 64, extend up to
4096 rows), in this order:

1. KV pool: a small profiling pool is written (as vLLM's cache writer does) and
   dropped as vLLM drops it (its owner deletes it; the backend holds no reference),
   then the real pool is allocated and filled. Checked: after the drop the census is
   back at the case baseline (the profiling bytes returned) and weak references to the
   old pool and its storage are dead; the real pool adds its bytes.
2. Preparation on the real pool: census before ``plan``; after ``plan`` (unchanged: a
   plan allocates nothing and holds no tensor); after ``prepare`` (back at the
   pre-prepare figure: every probe freed, each probe's weak reference dead; the peak
   during preparation is reported); after the caller's scratch and after binding
   caller-owned live inputs (``bind`` itself allocates nothing).
3. After ``freeze``: one eager ``run(binding)`` (the session raises if it compiled
   anything), a CUDA graph captured around ``run(binding)``, then replays with new q /
   indices / lengths copied into the bound buffers, each checked against
   ``sparse_mla_reference`` within ``OUT_REL_ERR`` / ``LSE_ABS_ERR``; no kernel variant
   compiled after capture. On CPU (``--smoke``) there is no graph: the same binding is
   re-run on the changed buffers instead. An extend run (T = max_tokens) is checked too.
4. A compile after ``freeze`` must raise: ``prepare`` of a new plan
   (``PreparationFrozen``), a run of a declared but unprepared plan
   (``SparseMLANotPrepared``), and, where the kernel tracks its compiled variants
   (Triton), a run whose q strides the probes did not have (``SparseMLANotPrepared``).
5. Teardown: dropping the graph, live inputs and the caller's scratch returns the
   census to the pre-plan figure (the session kept none of them); ``release(plan)``
   leaves it there; dropping the real pool returns it to the case baseline.

Census source: on CUDA, ``torch.cuda.memory_allocated`` / ``memory_reserved`` (exact,
block-rounded bytes) plus the tensors on the device that ``gc`` can see. On CPU
(``--smoke``) there is no allocator counter, so "allocated" is ledger-style: the bytes
of the unique storages behind every live tensor ``gc`` can see (blind to tensors held
only from C++, which the CUDA allocator census is not); the windows around ``plan``
and ``prepare`` are also traced with the CPU allocator's profiler events.

    python benchmarks/sparse_ownership.py --out $OUT/sparse_ownership.json   # GPU
    python benchmarks/sparse_ownership.py --smoke --out /tmp/o.json          # CPU, seconds

Exit status 0 only when every check passed (1: a check failed, 2: no CUDA device).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

if "--smoke" in sys.argv:
    # The smoke run is CPU only; the interpreter lets the Triton kernels (and their
    # compiled-variant tracking, which the freeze check needs) run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_mla import environment, errors  # reuse: same tolerances, same env record

from vllm_mla import envs
from vllm_mla.memory import AllocationTrace, storage_key
from vllm_mla.ops import sparse_mla as sm
from vllm_mla.ops.base import TRITON_AVAILABLE
from vllm_mla.ops.sparse_mla import (
    HEAD_DIM,
    LATENT,
    ROPE,
    PreparationFrozen,
    PreparationSession,
    SparseMLACaps,
    SparseMLANotPrepared,
    pack_rows,
    sparse_mla_reference,
)

SCALE = HEAD_DIM**-0.5  # the session's default softmax scale (run() passes it)
FILL_CHUNK = 1 << 16  # pool rows packed per step (bounds the fill's temporaries)


@dataclasses.dataclass(frozen=True)
class Case:
    """One launch site: its declared capacities and the pools it is bound to."""

    kv_format: str
    num_heads: int
    topk: int
    max_tokens: int  # extend rows declared (and run once, eagerly)
    graph_tokens: int  # the decode batch the graph is captured at
    pool_blocks: int  # the real pool
    profiling_blocks: int  # vLLM's minimal profiling pool
    block_size: int = 64

    @property
    def name(self) -> str:
        return f"{self.kv_format}/H{self.num_heads}/K{self.topk}/T{self.max_tokens}"

    def caps(self) -> SparseMLACaps:
        return SparseMLACaps(
            max_tokens=self.max_tokens,
            num_heads=self.num_heads,
            topk=self.topk,
            kv_format=self.kv_format,
            block_size=self.block_size,
            split_query=True,  # (q_nope, q_pe) views of one [T, H, 576] buffer, as vLLM
            with_lengths=True,
            return_lse=True,  # DCP needs it; also lets each replay check lse
        )


GPU_CASES = (
    Case("fp8_ds_mla", 16, 2048, 4096, 32, pool_blocks=4096, profiling_blocks=256),
    Case("bf16", 16, 2048, 4096, 32, pool_blocks=4096, profiling_blocks=256),
    Case("fp8_ds_mla", 64, 2048, 4096, 32, pool_blocks=4096, profiling_blocks=256),
)
SMOKE_CASES = (
    # Interpreted launches dominate the smoke run: few tokens, but top-k 64 still splits
    # (two 32-row chunks), so the scratch and combine paths run.
    Case("fp8_ds_mla", 16, 64, 2, 2, pool_blocks=4, profiling_blocks=1),
    Case("bf16", 3, 64, 2, 1, pool_blocks=4, profiling_blocks=1),
)


# ---------------------------------------------------------------------------- census


def live_tensors(device_type: str) -> tuple[int, int]:
    """(tensors gc can see on ``device_type``, bytes of their unique storages)."""
    storages: dict[tuple, int] = {}
    count = 0
    with warnings.catch_warnings():
        # isinstance() on some deprecated torch proxies (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.device.type != device_type:
                    continue
                count += 1
                nbytes = obj.untyped_storage().nbytes()
            except Exception:  # fake / meta / exotic subclasses: counted, no storage
                continue
            if nbytes:
                key = storage_key(obj)  # a view counts its whole storage, once
                storages[key] = max(storages.get(key, 0), nbytes)
    return count, sum(storages.values())


class Census:
    """Snapshots of what is alive on one device (see the module docstring for sources)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.source = "cuda caching allocator" if self.cuda else "ledger (gc-visible storages)"
        self.rows: list[dict] = []

    def allocated(self) -> int:
        """Bytes allocated now: the CUDA allocator's figure, or the CPU ledger's."""
        gc.collect()  # a dead cycle is not an owner
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return live_tensors("cpu")[1]

    def snap(self, case: str, label: str) -> dict:
        if self.cuda:
            allocated = self.allocated()
            tensors, tensor_bytes = live_tensors("cuda")
        else:
            gc.collect()
            tensors, tensor_bytes = live_tensors("cpu")
            allocated = tensor_bytes
        row = {
            "case": case,
            "label": label,
            "allocated": allocated,
            "reserved": torch.cuda.memory_reserved(self.device) if self.cuda else None,
            "tensors": tensors,
            "tensor_bytes": tensor_bytes,
        }
        self.rows.append(row)
        return row


class Checks:
    """Named pass/fail records; the exit status is their conjunction."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def __call__(self, case: str, name: str, ok: bool, detail: str = "") -> bool:
        self.rows.append({"case": case, "name": name, "ok": bool(ok), "detail": detail})
        mark = "ok  " if ok else "FAIL"
        print(f"  [{mark}] {name}" + (f": {detail}" if detail else ""), flush=True)
        return bool(ok)

    def raises(self, case: str, name: str, error: type, fn: Callable[[], object]) -> bool:
        try:
            fn()
        except error as exc:
            return self(case, name, True, f"{type(exc).__name__}: {str(exc)[:120]}")
        except Exception as exc:
            return self(case, name, False, f"expected {error.__name__}, got {exc!r:.160}")
        return self(case, name, False, f"expected {error.__name__}, nothing raised")


def same(a: dict, b: dict) -> tuple[bool, str]:
    """Whether two snapshots agree on allocated bytes and live tensors."""
    ok = a["allocated"] == b["allocated"] and a["tensors"] == b["tensors"]
    detail = (
        f"allocated {a['allocated']:,} -> {b['allocated']:,}, "
        f"tensors {a['tensors']} -> {b['tensors']}"
    )
    return ok, detail


def tensors_in(obj: object) -> list[torch.Tensor]:
    """Every tensor reachable through dataclass fields, tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, tuple | list):
        return [t for item in obj for t in tensors_in(item)]
    return []


# ---------------------------------------------------------------------------- inputs


def new_pool(kv_format: str, block_size: int, blocks: int, device: torch.device) -> torch.Tensor:
    """A ``[blocks, block_size, record]`` pool, as vLLM allocates one layer's cache."""
    width, dtype = sm.record_width(kv_format)
    return torch.zeros(blocks, block_size, width, dtype=dtype, device=device)


def fill_rows(pool: torch.Tensor, kv_format: str, gen: torch.Generator, limit: int | None = None):
    """Write packed random rows into ``pool`` (what vLLM's cache writer does)."""
    rows = pool.view(-1, pool.shape[-1])
    total = rows.shape[0] if limit is None else min(limit, rows.shape[0])
    for start in range(0, total, FILL_CHUNK):
        n = min(FILL_CHUNK, total - start)
        kv_c = torch.randn(n, LATENT, generator=gen, device=pool.device)
        k_pe = torch.randn(n, ROPE, generator=gen, device=pool.device)
        rows[start : start + n] = pack_rows(kv_c, k_pe, kv_format)


class Live:
    """Caller-owned live inputs of one binding: q buffer, indices, lengths, out."""

    def __init__(self, caps: SparseMLACaps, tokens: int, device: torch.device) -> None:
        h, k = caps.num_heads, caps.topk
        self.q = torch.zeros(tokens, h, HEAD_DIM, dtype=caps.q_dtype, device=device)
        self.idx = torch.full((tokens, k), -1, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.out = torch.empty(tokens, h, LATENT, dtype=caps.q_dtype, device=device)

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q[..., :LATENT], self.q[..., LATENT:]

    def load(self, q: torch.Tensor, idx: torch.Tensor, lengths: torch.Tensor) -> None:
        self.q.copy_(q)
        self.idx.copy_(idx)
        self.lengths.copy_(lengths)


def make_inputs(
    caps: SparseMLACaps, tokens: int, num_rows: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, 576]; per token top-k distinct rows (an odd stride over a power-of-two
    row count), 5% of them -1; ragged lengths (token 0 full, some may be 0)."""
    t, k = tokens, caps.topk
    q = torch.randn(t, caps.num_heads, HEAD_DIM, generator=gen, device=device)
    start = torch.randint(0, num_rows, (t, 1), generator=gen, device=device)
    step = 2 * torch.randint(0, max(1, num_rows // 2), (t, 1), generator=gen, device=device) + 1
    idx = ((start + step * torch.arange(k, device=device)) % num_rows).int()
    idx[torch.rand(t, k, generator=gen, device=device) < 0.05] = -1
    lengths = torch.randint(0, k + 1, (t,), generator=gen, device=device, dtype=torch.int32)
    lengths[0] = k
    return q.to(caps.q_dtype), idx, lengths


def compare(out, lse, q, pool, idx, lengths, kv_format) -> dict:
    """Errors of (out, lse) against the reference on the given (source) inputs."""
    ref, ref_lse = sparse_mla_reference(q, pool, idx, SCALE, kv_format=kv_format, lengths=lengths)
    return errors(out, lse, ref, ref_lse)


# ---------------------------------------------------------------------------- phases


def profiling_phase(owner, census, checks, case, base, gen) -> None:
    """Write into the profiling pool, drop it as vLLM does; check it is gone."""
    c = case.name
    owner["kv_cache"] = new_pool(
        case.kv_format, case.block_size, case.profiling_blocks, census.device
    )
    fill_rows(owner["kv_cache"], case.kv_format, gen, limit=64)  # a profile run's writes
    refs = {
        "pool": weakref.ref(owner["kv_cache"]),
        "storage": weakref.ref(owner["kv_cache"].untyped_storage()),
    }
    used = census.snap(c, "profiling pool written")
    profiling_bytes = used["allocated"] - base["allocated"]
    # vLLM drops its reference to the profiling pool; the backend keeps none.
    del owner["kv_cache"]
    gc.collect()
    dropped = census.snap(c, "profiling pool dropped")
    alive = [name for name, ref in refs.items() if ref() is not None]
    checks(c, "old pool and storage unreferenced", not alive, f"alive: {alive or 'none'}")
    ok = dropped["allocated"] == base["allocated"]
    checks(
        c,
        "profiling bytes returned",
        ok,
        f"{profiling_bytes:,} bytes used; allocated {dropped['allocated']:,} "
        f"vs baseline {base['allocated']:,}",
    )


def real_pool_phase(owner, census, checks, case, base, gen) -> None:
    c = case.name
    owner["kv_cache"] = new_pool(case.kv_format, case.block_size, case.pool_blocks, census.device)
    allocated = census.snap(c, "real pool allocated")
    pool_bytes = allocated["allocated"] - base["allocated"]
    checks(
        c,
        "allocated == baseline + real pool",
        pool_bytes >= owner["kv_cache"].untyped_storage().nbytes(),
        f"pool {owner['kv_cache'].untyped_storage().nbytes():,} bytes, allocator +{pool_bytes:,}",
    )
    fill_rows(owner["kv_cache"], case.kv_format, gen)


def prepare_phase(session, caps, impl, census, checks, c, report) -> tuple:
    """plan + prepare with the census around each; returns (plan, pre-plan snapshot)."""
    before = census.snap(c, "before plan")
    with AllocationTrace(census.device) as trace:
        p = session.plan(caps, impl=impl)
    after_plan = census.snap(c, "after plan")
    ok, detail = same(before, after_plan)
    events = len(trace.allocations())
    checks(c, "plan allocates nothing", ok and events == 0, f"{detail}; {events} alloc events")
    checks(c, "plan holds no tensor", not tensors_in(p))

    probes: list = report["_probes"]
    if census.cuda:
        torch.cuda.reset_peak_memory_stats(census.device)
        session.prepare(p)  # raises ProbeRetained itself if a probe survives
        peak = torch.cuda.max_memory_allocated(census.device) - after_plan["allocated"]
        persistent = None
    else:
        with AllocationTrace("cpu") as trace:
            session.prepare(p)
        peak, persistent = trace.transient_peak(), trace.persistent_bytes()
    after_prepare = census.snap(c, "after prepare")
    ok, detail = same(before, after_prepare)
    if persistent is not None:
        # Reported, not gated: Triton's CPU interpreter keeps the storages of its last
        # launch until its next launch (they are freed then), so the CPU trace shows the
        # last probe launch's buffers; the ledger and the weakrefs are the CPU criterion.
        detail += f"; CPU trace: {persistent:,} bytes held past prepare by the interpreter"
        report["prepare_trace_persistent_bytes"] = persistent
    checks(c, "prepare returns to the pre-prepare figure", ok, detail)
    alive = [name for name, ref, _ in probes if ref() is not None]
    checks(
        c,
        "every probe freed (weakrefs)",
        not alive,
        f"{len(probes)} probes, {sum(b for *_, b in probes):,} bytes; alive: {alive or 'none'}",
    )
    report.update(
        prepare_peak_bytes=peak,
        probe_count=len(probes),
        probe_bytes=sum(b for *_, b in probes),
        variants=len(p.variants),
        plan_scratch_bytes=p.scratch_bytes,
    )
    return p, before


def replay_phase(session, binding, live, pool, census, checks, c, case, gen, rounds) -> dict:
    """Eager run after freeze, then graph capture (CUDA) and replays on changed inputs."""
    caps = binding.plan.caps
    num_rows = pool.shape[0] * pool.shape[1]
    frozen = sm.compiled_variants()
    q, idx, lengths = make_inputs(caps, case.graph_tokens, num_rows, gen, census.device)
    live.load(q, idx, lengths)
    out, lse = session.run(binding)  # raises SparseMLANotPrepared if it compiled
    e = compare(out, lse, q, pool, idx, lengths, case.kv_format)
    checks(c, "eager run after freeze matches", e["ok"], f"rel {e['rel_err']:.2e}")
    graph = None
    if census.cuda:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = session.run(binding)  # lse lives in the graph's pool
    results = []
    for _ in range(rounds):
        q, idx, lengths = make_inputs(caps, case.graph_tokens, num_rows, gen, census.device)
        live.load(q, idx, lengths)  # changed live inputs, same buffers
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        if graph is not None:
            graph.replay()
        else:  # CPU: the same binding re-run (no graphs on CPU); lse is returned afresh
            out, lse = session.run(binding)
        results.append(compare(out, lse, q, pool, idx, lengths, case.kv_format))
    worst = {
        "case": c,
        "kind": "cuda graph" if graph is not None else "eager re-run (CPU)",
        "T": case.graph_tokens,
        "rounds": rounds,
        "rel_err": max(r["rel_err"] for r in results),
        "lse_err": max(r["lse_err"] for r in results),
        "nan": any(r["nan"] for r in results),
        "ok": all(r["ok"] for r in results),
    }
    checks(
        c,
        f"{worst['kind']} x{rounds} with changed q/indices/lengths matches the reference",
        worst["ok"],
        f"worst rel {worst['rel_err']:.2e} (< {sm.OUT_REL_ERR}), "
        f"lse {worst['lse_err']:.2e} (< {sm.LSE_ABS_ERR})",
    )
    checks(c, "no kernel variant compiled after freeze", sm.compiled_variants() == frozen)
    census.snap(c, "after capture + replays" if graph is not None else "after re-runs")
    # The graph and its lse output die with this frame.
    return worst


def extend_check(session, p, pool, scratch, census, checks, c, case, gen) -> None:
    caps = p.caps
    num_rows = pool.shape[0] * pool.shape[1]
    live = Live(caps, caps.max_tokens, census.device)
    q, idx, lengths = make_inputs(caps, caps.max_tokens, num_rows, gen, census.device)
    live.load(q, idx, lengths)
    binding = session.bind(
        p, scratch=scratch, q=live.split(), kv_cache=pool, indices=live.idx,
        lengths=live.lengths, out=live.out,
    )  # fmt: skip
    out, lse = session.run(binding)
    e = compare(out, lse, q, pool, idx, lengths, case.kv_format)
    checks(
        c, f"extend T={caps.max_tokens} after freeze matches", e["ok"], f"rel {e['rel_err']:.2e}"
    )


def frozen_compile_checks(session, p, impl, live, pool, scratch, checks, c) -> None:
    """Every way a compile could happen after freeze must raise."""
    other = session.plan(p.caps, impl=impl)
    checks.raises(
        c, "prepare after freeze raises", PreparationFrozen, lambda: session.prepare(other)
    )
    unprepared = session.bind(
        other, scratch=scratch, q=live.split(), kv_cache=pool, indices=live.idx,
        lengths=live.lengths, out=live.out,
    )  # fmt: skip
    checks.raises(
        c, "run of an unprepared plan after freeze raises", SparseMLANotPrepared,
        lambda: session.run(unprepared),
    )  # fmt: skip
    session.release(other)
    if impl != "triton":
        checks(
            c, "new-stride compile after freeze raises", True, f"skipped: {impl} compiles nothing"
        )
        return
    # Last on purpose: this launch does compile (that is the defect being caught), which
    # leaves the kernel's variant count above the frozen one for this session.
    t, h = live.q.shape[:2]
    wide = torch.zeros(t, h, HEAD_DIM + 1, dtype=live.q.dtype, device=live.q.device)
    odd = wide[..., :HEAD_DIM]  # row stride H * 577: not a multiple of 16
    odd.copy_(live.q)
    binding = session.bind(
        p, scratch=scratch, q=(odd[..., :LATENT], odd[..., LATENT:]), kv_cache=pool,
        indices=live.idx, lengths=live.lengths,
    )  # fmt: skip
    checks.raises(
        c, "new-stride compile after freeze raises", SparseMLANotPrepared,
        lambda: session.run(binding),
    )  # fmt: skip


# ---------------------------------------------------------------------------- driver


def run_case(case, device, impl, census, checks, gen, rounds) -> dict:
    """One case end to end (see the module docstring); returns its report."""
    c = case.name
    print(f"\n== {c} (impl {impl})", flush=True)
    report: dict = {"case": c, **dataclasses.asdict(case), "impl": impl, "_probes": []}
    base = census.snap(c, "case baseline")
    owner: dict[str, torch.Tensor] = {}  # vLLM's per-layer kv_caches: the pool's only owner
    profiling_phase(owner, census, checks, case, base, gen)
    real_pool_phase(owner, census, checks, case, base, gen)
    pool = owner["kv_cache"]
    report["pool_bytes"] = pool.untyped_storage().nbytes()

    probes = report["_probes"]

    def observe(name: str, tensor: torch.Tensor) -> None:  # weak references only
        probes.append((f"{name}{list(tensor.shape)}", weakref.ref(tensor), tensor.nbytes))

    session = PreparationSession(device, probe_observer=observe)
    caps = case.caps()
    p, before_plan = prepare_phase(session, caps, impl, census, checks, c, report)

    # The caller owns the scratch (the vLLM impl takes it from vLLM's workspace).
    scratch = torch.empty(p.scratch_bytes, dtype=torch.uint8, device=device)
    scratch_ref = weakref.ref(scratch.untyped_storage())
    after_scratch = census.snap(c, "after caller scratch")
    scratch_delta = after_scratch["allocated"] - before_plan["allocated"]
    checks(
        c,
        "scratch holds the plan's bytes",
        scratch_delta >= p.scratch_bytes,
        f"plan {p.scratch_bytes:,}, allocated +{scratch_delta:,}",
    )
    live = Live(caps, case.graph_tokens, device)
    q_views = live.split()
    before_bind = census.allocated()
    binding = session.bind(
        p, scratch=scratch, q=q_views, kv_cache=pool, indices=live.idx, lengths=live.lengths,
        out=live.out,
    )  # fmt: skip
    after_bind = census.snap(c, "after scratch + live inputs + bind")
    checks(
        c,
        "bind allocates nothing",
        after_bind["allocated"] == before_bind,
        f"{before_bind:,} -> {after_bind['allocated']:,}",
    )
    caller = {id(t) for t in (*q_views, pool, live.idx, live.lengths, live.out, scratch)}
    checks(c, "binding holds only caller inputs", {id(t) for t in tensors_in(binding)} <= caller)

    session.freeze()
    report["replay"] = replay_phase(
        session, binding, live, pool, census, checks, c, case, gen, rounds
    )
    extend_check(session, p, pool, scratch, census, checks, c, case, gen)
    frozen_compile_checks(session, p, impl, live, pool, scratch, checks, c)

    del binding, q_views, live, scratch
    dropped = census.snap(c, "graph + live inputs + scratch dropped")
    ok, detail = same(before_plan, dropped)
    alive = scratch_ref() is not None
    checks(
        c,
        "the session keeps nothing of the caller's (scratch freed with the caller's ref)",
        ok and not alive,
        f"{detail}; alive: {alive}",
    )
    session.release(p)
    released = census.snap(c, "after release(plan)")
    ok, detail = same(before_plan, released)
    checks(c, "release(plan) leaves the plan's baseline", ok, detail)
    del pool, owner["kv_cache"]
    final = census.snap(c, "real pool dropped")
    ok, detail = same(base, final)
    checks(c, "case ends at its baseline", ok, detail)
    report.pop("_probes")
    return report


def warm_up(device: torch.device, gen: torch.Generator) -> None:
    """Run the reference once so lazily created, persistent state (the cuBLAS handle and
    its workspace, which the caching allocator keeps) exists before any baseline."""
    pool = new_pool("bf16", 64, 1, device)
    caps = SparseMLACaps(max_tokens=2, num_heads=16, topk=64, kv_format="bf16")
    q, idx, lengths = make_inputs(caps, 2, 64, gen, device)
    out, lse = sparse_mla_reference(q, pool, idx, SCALE, kv_format="bf16", lengths=lengths)
    errors(out, lse, out, lse)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def markdown(report: dict) -> str:
    title = report["env"].get("gpu", "CPU smoke")
    lines = [f"# Sparse-MLA ownership ({title})", ""]
    lines += [f"impl `{report['impl']}`; census: {report['census_source']}.", ""]
    lines += [
        "| case | point | allocated | vs case baseline | reserved | live tensors |",
        "|---|---|---|---|---|---|",
    ]
    base: dict[str, int] = {}
    for r in report["census"]:
        b = base.setdefault(r["case"], r["allocated"])
        lines.append(
            f"| {r['case']} | {r['label']} | {fmt_bytes(r['allocated'])} | "
            f"{r['allocated'] - b:+,} | {fmt_bytes(r['reserved'])} | {r['tensors']} |"
        )
    lines += [
        "",
        "| case | variants | probes | probe bytes | prepare peak | plan scratch | pool |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["cases"]:
        lines.append(
            f"| {r['case']} | {r.get('variants', '-')} | {r.get('probe_count', '-')} | "
            f"{fmt_bytes(r.get('probe_bytes'))} | {fmt_bytes(r.get('prepare_peak_bytes'))} | "
            f"{fmt_bytes(r.get('plan_scratch_bytes'))} | {fmt_bytes(r.get('pool_bytes'))} |"
        )
    lines += ["", "| case | replay | T | rounds | rel err | lse err | ok |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for r in report["replays"]:
        lines.append(
            f"| {r['case']} | {r['kind']} | {r['T']} | {r['rounds']} | {r['rel_err']:.2e} | "
            f"{r['lse_err']:.2e} | {r['ok']} |"
        )
    lines += ["", "| case | check | ok | detail |", "|---|---|---|---|"]
    for r in report["checks"]:
        detail = r["detail"].replace("|", "/")
        lines.append(f"| {r['case']} | {r['name']} | {r['ok']} | {detail} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (markdown beside it)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, ledger census")
    parser.add_argument("--rounds", type=int, default=None, help="replays (GPU 8, smoke 2)")
    args = parser.parse_args()
    if args.smoke:
        device = torch.device("cpu")
        triton_ok = TRITON_AVAILABLE and envs.triton_interpret()
        impl, cases = ("triton" if triton_ok else "reference"), SMOKE_CASES
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        impl, cases = sm.select_impl(device), GPU_CASES
    rounds = args.rounds or (2 if args.smoke else 8)
    gen = torch.Generator(device=device).manual_seed(0)
    started = time.perf_counter()
    # Everything imported so far is permanent: full collections (one per snapshot) then
    # skip it. No tensor of this script exists yet, so the scans miss none of ours.
    gc.collect()
    gc.freeze()
    warm_up(device, gen)
    census, checks = Census(device), Checks()
    report: dict = {
        "env": environment(),
        "device": str(device),
        "impl": impl,
        "census_source": census.source,
        "cases": [],
        "replays": [],
    }
    for case in cases:
        try:
            result = run_case(case, device, impl, census, checks, gen, rounds)
        except Exception:
            # Record and go on: one broken case must not hide the others' evidence.
            checks(case.name, "case ran to the end", False, traceback.format_exc(limit=4)[-600:])
            result = {"case": case.name, "error": True}
        gc.collect()
        report["cases"].append(result)
        if "replay" in result:
            report["replays"].append(result.pop("replay"))
    report["census"] = census.rows
    report["checks"] = checks.rows
    report["seconds"] = time.perf_counter() - started
    report["ok"] = bool(checks.rows) and all(r["ok"] for r in checks.rows)
    text = markdown(report)
    print()
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, default=str))
        args.out.with_suffix(".md").write_text(text)
    print("PASS" if report["ok"] else "FAIL", f"({report['seconds']:.1f} s)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
