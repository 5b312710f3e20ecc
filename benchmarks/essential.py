"""The first GPU window in one part: every kernel's correctness and the headline timings.

Run by ``bash benchmarks/gpu_check.sh essential`` one step per process (each under its own
timeout, so a failing or hung step never stops the others); every step merges its section
into ``DIR/essential.json`` after each row, so a timeout keeps what finished.

    python benchmarks/essential.py query   --out DIR  # safe bmm, absorbed bmm, fused query
    python benchmarks/essential.py sparse  --out DIR  # sparse MLA decode + extend, every record
    python benchmarks/essential.py indexer --out DIR  # DSA indexer insert / logits / top-k
    python benchmarks/essential.py dsv4    --out DIR  # DeepSeek-V4 attention + record writer
    python benchmarks/essential.py report  --out DIR --step NAME=RC:SECONDS ...

Each step: correctness on fresh inputs against the op's torch reference first, then CUDA
graph capture + replay on fresh inputs copied into the captured buffers, then one timing
per op with its baseline or roofline (HBM copy bandwidth measured in the same step).
``report`` records the shell's exit codes (124 = timeout), writes ``DIR/essential.md``
(rows ready for benchmarks/RESULTS.md: date, GPU, driver, torch, Triton, commit) and prints
the results table.

Dry mode (``VLLM_MLA_GPU_DRY=1``, or automatic without CUDA): the same steps on CPU at tiny
shapes, Triton kernels in the interpreter; correctness runs, graph capture and timings
print a skip message, and the JSON and rows say "not run". It checks the plumbing only:
no figure from it is a GPU result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

try:
    import torch
except ImportError as exc:  # nothing below can run: say which Python this is, no traceback
    print(f"essential: torch does not import under Python {sys.version.split()[0]}: {exc}")
    sys.exit(1)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

DRY = os.environ.get("VLLM_MLA_GPU_DRY", "") not in ("", "0") or not torch.cuda.is_available()
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

MIN_TORCH, MIN_TRITON = (2, 11), (3, 6)  # the GPU image: torch 2.11.0+cu130, Triton 3.6.0
STEPS = ("query", "sparse", "indexer", "dsv4")
NOT_RUN = "not run"
# One bf16 rounding of an fp32 result (8 significant bits, round to nearest even): each
# element moves by <= 2^-8 of itself, so ||err|| / ||ref|| <= 2^-8 = 3.9e-3; the fp32 sums
# of exact bf16 products (K <= 192) in another order add ~1e-4 of the norm at most.
BF16_REL = 2.0**-8 + 1e-4


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:2] if p.isdigit())


def version_problem() -> str | None:
    """Why this torch / Triton cannot run the kernels, naming the versions; None when fine."""
    if _version(torch.__version__) < MIN_TORCH:
        return f"torch {torch.__version__} is older than {'.'.join(map(str, MIN_TORCH))}"
    try:
        import triton
    except ImportError as exc:
        return f"Triton does not import ({exc}); torch {torch.__version__}"
    if _version(triton.__version__) < MIN_TRITON:
        return f"Triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON))}"
    return None


# ---------------------------------------------------------------- report file


def machine() -> dict:
    """GPU name and driver from nvidia-smi (or why not), plus common.environment()."""
    import common

    env = {**common.environment(), "dry": DRY}
    env["cuda"] = torch.version.cuda
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.splitlines()[0]
        env["gpu"], env["driver"] = (s.strip() for s in line.split(",", 1))
    except (OSError, subprocess.SubprocessError, IndexError, ValueError) as exc:
        env.setdefault("gpu", "none (dry run)" if DRY else "unknown")
        env["driver"] = "n/a (no nvidia-smi)" if isinstance(exc, OSError) else "n/a"
    return env


class Report:
    """``DIR/essential.json``: env + one section per step, rewritten after every row."""

    def __init__(self, out_dir: Path):
        self.path = out_dir / "essential.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self.data = json.loads(self.path.read_text())
        else:
            self.data = {"env": machine(), "dry": DRY, "steps": {}}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


class Section:
    """One step's rows. ``check`` / ``timing`` run a function, never raise: an exception
    becomes a failed row with a one-line message (the traceback's tail goes to the JSON)."""

    def __init__(self, report: Report, name: str):
        self.report, self.name, self.started = report, name, time.perf_counter()
        self.data = {"status": "running", "dry": DRY, "checks": [], "timings": [], "notes": []}
        report.data["steps"][name] = self.data
        report.save()

    def _save(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.started, 1)
        self.report.save()

    def note(self, text: str) -> None:
        print(f"[{self.name}] {text}", flush=True)
        self.data["notes"].append(text)
        self._save()

    def _run(self, kind: str, label: str, fn, **meta) -> dict:
        row = {"name": label, **meta}
        try:
            row.update(fn())
        except Exception as exc:
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
            row["trace"] = traceback.format_exc().splitlines()[-8:]
        self.data[kind].append(row)
        shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}
        shown.pop("trace", None)
        print(f"[{self.name}] {kind[:-1]} {shown}", flush=True)
        self._save()
        return row

    def check(self, label: str, fn, **meta) -> dict:
        return self._run("checks", label, fn, **meta)

    def timing(self, label: str, fn, **meta) -> dict:
        if DRY:
            row = {"name": label, **meta, "status": NOT_RUN, "ok": True}
            self.data["timings"].append(row)
            print(f"[{self.name}] timing {label}: skipped (dry run: no GPU)", flush=True)
            self._save()
            return row
        return self._run("timings", label, fn, **meta)

    def graph(self, label: str, fn, **meta) -> dict:
        """A CUDA-graph check: runs on a GPU; in dry mode a skip row."""
        if DRY:
            row = {"name": label, **meta, "status": NOT_RUN, "ok": True, "graph": True}
            self.data["checks"].append(row)
            print(f"[{self.name}] graph {label}: skipped (dry run: no GPU)", flush=True)
            self._save()
            return row
        return self._run("checks", label, fn, graph=True, **meta)

    def finish(self) -> int:
        failed = [r for r in self.data["checks"] + self.data["timings"] if not r.get("ok", True)]
        self.data["status"] = "failed" if failed else ("dry" if DRY else "ok")
        self._save()
        print(f"[{self.name}] {self.data['status']}: {len(failed)} failed rows", flush=True)
        return 1 if failed else 0


def bounded(row: dict, bound, model: str) -> dict:
    """A reused benchmark check's row, with the bound it applied and its error model."""
    return {**row, "bound": bound, "model": model}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
    return float("inf") if err != err else err  # NaN (an unwritten element) fails


# ---------------------------------------------------------------- query: bmm, absorbed, fused


def safe_bmm_check(t: int, h: int, q_dim: int, latent: int, device) -> dict:
    """``safe_mla_query_bmm`` on vLLM's strided split + transpose view of q, the weight a
    view into a kv_b pack, every operand ending at its allocation's end, out poisoned."""
    import query_path as qp

    from vllm_mla.ops import query_bmm

    gen = torch.Generator().manual_seed(t * 1000 + h)
    q = qp.tail_view((t, h, q_dim + qp.R), torch.bfloat16, device)
    q.copy_(torch.randn(q.shape, generator=gen).to(device))
    pack = qp.tail_view((h, q_dim + qp.V, latent), torch.bfloat16, device)
    pack.copy_((torch.randn(pack.shape, generator=gen) * 0.05).to(device))
    query, weight = q[..., :q_dim].transpose(0, 1), pack[:, :q_dim]
    out = qp.tail_view((t, h, latent), torch.bfloat16, device).fill_(float("nan"))
    query_bmm.safe_mla_query_bmm(query, weight, out.transpose(0, 1))
    want = torch.bmm(query.float(), weight.float()).transpose(0, 1)
    err = rel_err(out, want)
    on_op = device.type != "cuda" or query_bmm.cuda_op_available()
    row = {"metric": "rel_err", "value": err, "bound": BF16_REL, "model": "bf16 out rounding"}
    row["path"] = "cuda-op" if device.type == "cuda" and on_op else "torch.bmm fallback"
    row["ok"] = err < BF16_REL and on_op
    if not on_op:
        row["error"] = f"the CUDA op is not loaded: {query_bmm.cuda_op_error()}"
    return row


def fused_check(m, h, p, fmt, out_dtype, device) -> dict:
    """query_path.check_case: fused vs staged (and, for BF16 weights, the safe op)."""
    import query_path as qp

    gen = torch.Generator().manual_seed(m * 100 + p)
    row = qp.check_case(m, h, p, fmt, out_dtype, device, gen)
    if "rel_err" in row:
        # fused and staged both round an fp32 sum to bf16: 2 roundings, <= 2 * 2^-8 = 7.8e-3
        # of the norm, + fp32 summation order ~1e-4; query_path's gate is 1e-2.
        row.update(metric="rel_err", value=row["rel_err"], bound=1e-2, model="2 bf16 roundings")
    else:
        # e4m3 of bf16 values one ulp apart differ by <= 1 code (e4m3 steps >= bf16 ulps).
        row.update(metric="max_code_diff", value=row["max_code_diff"], bound=1, model="1 code")
    return row


def absorbed_check(m: int, shape: str, device) -> dict:
    """decode_path.check: vLLM's two absorption bmms through every mode (bmm on the BF16
    pair, safe = the pair routed to our op, direct = MXFP8 views in Triton) vs the fp32
    reference, into poisoned strided outputs whose padding must stay untouched."""
    import decode_path as dp

    row = dp.check(m, shape, device, torch.Generator().manual_seed(m))
    worst = max(max(row[mode]["ql"], row[mode]["v"]) for mode in dp.MODES)
    # The BF16 pair holds the MXFP8 values exactly (e4m3 x 2^k fits bf16); out and the
    # reference each round to bf16 once: <= 2 * 2^-8 = 7.8e-3 of the norm, + fp32 order
    # ~1e-4; decode_path's gate is 1e-2.
    return {
        "metric": "rel_err",
        "value": worst,
        "bound": 1e-2,
        "model": "2 bf16 roundings",
        "modes": {mode: row[mode] for mode in dp.MODES},
        "ok": row["ok"],
    }


def time_safe_bmm(m: int, h: int, p: int, device, bandwidth: float) -> dict:
    """Safe op vs torch.bmm on the same strided view (upstream's call) and on a contiguous
    copy made outside the timed region, ``LAYERS`` layers per graph (weights from HBM)."""
    import common
    import query_path as qp

    from vllm_mla.ops import query_bmm

    q, weights, _, _ = qp.make_case(
        m, h, p, "bf16", torch.bfloat16, device, torch.Generator().manual_seed(7)
    )
    qt = q[..., :p].transpose(0, 1)
    q_copy = qt.contiguous()
    lat = torch.empty(h, m, qp.L, dtype=torch.bfloat16, device=device)
    layers = len(weights)
    row = {
        "safe_us": common.graph_time_us(
            lambda: [query_bmm.safe_mla_query_bmm(qt, w, lat) for w in weights]
        )
        / layers,
        "bmm_strided_us": common.graph_time_us(lambda: [torch.bmm(qt, w, out=lat) for w in weights])
        / layers,
        "bmm_contiguous_us": common.graph_time_us(
            lambda: [torch.bmm(q_copy, w, out=lat) for w in weights]
        )
        / layers,
    }
    nbytes = h * p * qp.L * 2 + m * h * (p + qp.L) * 2
    row["roofline_us"] = nbytes / bandwidth * 1e6
    row.update(ours_us=row["safe_us"], base_us=row["bmm_strided_us"], base="torch.bmm (strided)")
    row["ratio"] = row["safe_us"] / row["bmm_strided_us"]
    row["ok"] = True
    return row


def time_decode_path(m: int, shape: str, device, bandwidth: float) -> list[dict]:
    """decode_path.time_shape: direct (MXFP8 views) vs bmm on the BF16 pair (both
    absorptions), and the fused query projection vs staged (MXFP8 views with FP8 out; BF16)."""
    import decode_path as dp

    pairs = (("mxfp8", "fp8"), ("bf16", "bf16"))  # decode_path.py times every pair
    t = dp.time_shape(m, shape, device, torch.Generator().manual_seed(11), query=pairs)
    h, p, v = dp.SHAPES[shape]
    direct_bytes = h * (p + v) * dp.L * (1 + 1 / 32) + m * h * (p + dp.L + dp.L + v) * 2
    return [
        {
            "op": "absorbed bmm: direct vs BF16 pair",
            "ours_us": t["direct_us"],
            "base_us": t["bmm_us"],
            "base": "torch.bmm on the BF16 pair",
            "ratio": t["direct_vs_bmm"],
            "safe_us": t["safe_us"],
            "roofline_us": direct_bytes / bandwidth * 1e6,
            "ok": True,
        },
        *(
            {
                "op": f"query projection: fused vs staged ({label})",
                "ours_us": t[f"fused_query_{tag}_us"],
                "base_us": t[f"staged_query_{tag.split('_')[1]}_us"],
                "base": "bmm + cat (+ quant) on the BF16 pair",
                "ratio": 1 / t[f"fused_speedup_{tag}"],
                "ok": True,
            }
            for tag, label in (("mxfp8_fp8", "MXFP8 views, e4m3 out"), ("bf16_bf16", "BF16"))
            if f"fused_query_{tag}_us" in t
        ),
    ]


def step_query(sec: Section, device) -> None:
    import common
    import decode_path as dp
    import query_path as qp

    from vllm_mla.ops import query_bmm

    sec.note(f"CUDA op loaded: {query_bmm.cuda_op_available()} {query_bmm.cuda_op_error() or ''}")
    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    safe = [(1, 16, 192, 512), (32, 16, 128, 512)] if not DRY else [(1, 4, 40, 48)]
    for t, h, q_dim, latent in safe:
        sec.check(
            "safe_bmm",
            lambda a=(t, h, q_dim, latent): safe_bmm_check(*a, device),
            shape=f"T{t} H{h} Q{q_dim} L{latent} strided, tails",
        )
    shapes = [("glm5-tp4", 1), ("dsv3-tp8", 32)] if not DRY else [("dsv3-tp8", 1)]
    for shape, m in shapes:
        sec.check(
            "absorbed_bmm",
            lambda a=(m, shape): absorbed_check(*a, device),
            shape=f"{shape} M{m} (bmm, safe, direct)",
        )
    fused = [(1, 16, 192), (32, 16, 128)] if not DRY else [(1, 2, 128)]
    for m, h, p in fused:
        for fmt in ("bf16", "mxfp8"):
            for out in (bf16, e4m3):
                sec.check(
                    "fused_query",
                    lambda a=(m, h, p, fmt, out): fused_check(*a, device),
                    shape=f"M{m} H{h} P{p} {fmt} -> {'bf16' if out == bf16 else 'e4m3'}",
                )
    # CUDA graphs: capture once, replay on fresh inputs copied into the captured buffers.
    for m, h, p, fmt in [(1, 16, 192, "mxfp8"), (32, 16, 128, "bf16")]:
        sec.graph(
            "graph fused_query + safe_bmm",
            lambda a=(m, h, p, fmt): bounded(
                qp.check_graph_replay(*a, bf16, device, torch.Generator().manual_seed(3)),
                "fused |diff| 0.25, safe 1e-2",
                # bf16 outputs |x| < 4: a correct replay is off by <= 1 ulp (2^-6) + fp32
                # order ~1e-4, < 0.02; a stale or unwritten one by O(1) or NaN
                "stale replay O(1); 1 bf16 ulp < 0.02",
            ),
            shape=f"M{m} H{h} P{p} {fmt}",
        )
    sec.graph(
        "graph absorbed_bmm",
        lambda: bounded(
            dp.check_graph(1, "glm5-tp4", device, torch.Generator().manual_seed(4)),
            1e-2,
            "bf16 weight + out, as eager",
        ),
        shape="glm5-tp4 M1 (bmm, safe, direct)",
    )
    bw = common.copy_bandwidth(device) if not DRY else None
    if bw:
        sec.data["copy_bandwidth_GBps"] = bw / 1e9
        sec.note(f"HBM copy bandwidth {bw / 1e9:.0f} GB/s (1 GiB device-to-device)")
    for m in (1, 32):
        sec.timing(
            "safe_bmm vs torch.bmm",
            lambda m=m: time_safe_bmm(m, 16, 192, device, bw),
            shape=f"GLM-5 TP4 T{m} H16 Q192 L512",
        )
    for m in (1, 32):
        label = f"GLM-5 TP4 M{m} H16 P192 V256"
        if DRY:
            sec.timing("absorbed bmm: direct vs BF16 pair", None, shape=label)
            sec.timing("query projection: fused vs staged", None, shape=label)
            continue
        try:
            rows = time_decode_path(m, "glm5-tp4", device, bw)
        except Exception as exc:
            rows = [
                {
                    "op": "decode_path.time_shape",
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                }
            ]
        for row in rows:
            sec.timing(row.pop("op"), lambda row=row: row, shape=label)


# ---------------------------------------------------------------- sparse MLA


def sparse_check(fmt, t, h, k, cache, device, gen, rope=64) -> dict:
    """sparse_mla.check: Triton vs sparse_mla_reference, out and LSE, ragged lengths."""
    import sparse_mla as sm

    row = sm.check(fmt, t, h, k, cache, device, gen, "triton", rope=rope)
    # forward.OUT_REL_ERR: both sides round out to bf16 (<= 2 * 2^-8 = 7.8e-3 of the norm),
    # the rest for the GPU's bf16 softmax weights (2^-8 each, random); LSE_ABS_ERR: exact
    # products, 576-term fp32 sums in two orders (forward.py states both).
    row.update(
        metric="rel_err / lse_err",
        value=row["rel_err"],
        bound=sm.OUT_REL_ERR,
        lse_bound=sm.LSE_ABS_ERR,
        model="2 bf16 roundings + bf16 P",
    )
    return row


def step_sparse(sec: Section, device) -> None:
    import sparse_mla as sm

    gen = torch.Generator(device=device).manual_seed(0)
    blocks, block_size, k, h = (4096, 64, 2048, 16) if not DRY else (8, 16, 40, 3)
    token_counts = (1, 32, 4096) if not DRY else (1, 3)
    bw = None
    if not DRY:
        import common

        bw = common.copy_bandwidth(device)
        sec.data["copy_bandwidth_GBps"] = bw / 1e9
        sec.note(f"HBM copy bandwidth {bw / 1e9:.0f} GB/s (1 GiB device-to-device)")
    for fmt in sm.KV_FORMATS:
        cache = sm.make_cache(fmt, blocks, block_size, device, gen)
        nvfp4 = sm.FORMAT[fmt].reader == "nvfp4"
        # nvfp4_ds_mla (the seeds' records): decode shapes, its writer and reader under
        # graph replay, one timing; the extend shape is the same loader at another T
        for t in token_counts if not nvfp4 else token_counts[:2]:
            kind = "decode" if t <= 64 else "extend"
            sec.check(
                f"sparse_mla {kind}",
                lambda a=(fmt, t, h, k, cache): sparse_check(*a, device, gen),
                shape=f"{fmt} T{t} H{h} K{k}",
            )
        sec.graph(
            "graph sparse_mla decode",
            lambda fmt=fmt, cache=cache: bounded(
                sm.graph_replay_check(fmt, cache, device, gen, rounds=3),
                sm.OUT_REL_ERR,
                "as eager; no compile after capture",
            ),
            shape=f"{fmt} T32 H16 K2048",
        )
        if nvfp4:
            sec.graph(
                "graph nvfp4_ds_mla cache writer",
                lambda: _writer_row(sm.writer_check(device, gen, rounds=3)),
                shape="T32, 1024 slots (one -1), saturating / zero / -0 rows",
            )
        for t in (1, 32) if not nvfp4 else (32,):
            sec.timing(
                "sparse_mla decode vs HBM",
                lambda a=(fmt, t, cache): _sparse_timing(*a, device, gen, bw),
                shape=f"GLM-5 TP4 {fmt} T{t} H16 K2048",
            )
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _flash_checks(sec, device, gen, blocks, block_size)
    # last (it compiles two more variants): decode context parallelism, the cache format
    # DCP serves in production; sparse_mla.py checks both formats and N=4 as well
    # MTP 3 decode batches (runs of 4 causal tokens per request): the seeds' DCP + MTP
    dcp = {**sm.DCP_GPU[0], "next_n": 4}
    sec.graph(
        "graph sparse_mla DCP LSE, MTP 3 batches",
        lambda: bounded(
            sm.dcp_check("fp8_ds_mla", device, gen, rounds=2, **dcp),
            sm.OUT_REL_ERR,
            "per rank as eager; vLLM's LSE merge of the ranks vs DCP 1; no compile after capture",
        ),
        shape=f"fp8_ds_mla N{dcp['n']} I{dcp['interleave']} T32 (8 x next_n 4) H{dcp['h']} K2048",
    )


def _writer_row(row: dict) -> dict:
    """The writer's row: bytes differing from the torch encoder, bound 0 (bit-exact)."""
    return {
        **row,
        "metric": "mismatched bytes",
        "value": row["mismatched_bytes"],
        "bound": 0,
        "model": "bit-exact: the rule in fp32 division and bit-level e4m3 / e2m1",
    }


def _flash_checks(sec: Section, device, gen, blocks: int, block_size: int) -> None:
    """GLM-5.3-Flash's decode shapes (latent 512 without RoPE: the ROPE=0 variants)."""
    import sparse_mla as sm

    heads = sm.FLASH_HEADS if not DRY else (3,)
    k = sm.FLASH_TOPK_WIDTH if not DRY else 40
    for fmt in sm.KV_FORMATS:
        cache = sm.make_cache(fmt, blocks, block_size, device, gen, rope=0)
        for h in heads:
            for t in (1, 32) if not DRY else (1,):
                sec.check(
                    "sparse_mla decode, no RoPE",
                    lambda a=(fmt, t, h, k, cache): sparse_check(*a, device, gen, rope=0),
                    shape=f"GLM-5.3-Flash {fmt} T{t} H{h} K{k} rope 0",
                )
        del cache


def _sparse_timing(fmt, t, cache, device, gen, bw) -> dict:
    import sparse_mla as sm

    row = sm.time_decode(fmt, t, 16, 2048, cache, device, gen, bw)
    roof_us = row["gathered_bytes"] / bw * 1e6
    row.update(
        ours_us=row["us"],
        base_us=roof_us,
        base="HBM roofline (T*K*record bytes)",
        ratio=row["us"] / roof_us,
        ok=True,
    )
    return row


# ---------------------------------------------------------------- DSA indexer


def indexer_insert_check(n: int, device) -> dict:
    """Triton insert vs reference.insert_keys: bit-identical bytes and scales."""
    from vllm_mla.ops.sparse_indexer import api as tk
    from vllm_mla.ops.sparse_indexer import reference

    gen = torch.Generator().manual_seed(n)
    blocks = -(-n // 64) + 2
    keys = (torch.randn(n, 128, generator=gen) * 3).bfloat16().to(device)
    slots = torch.randperm(blocks * 64, generator=gen)[:n].to(device)
    slots[::17] = -1  # skipped slots
    ours = torch.zeros(blocks, 64, reference.RECORD_BYTES, dtype=torch.uint8, device=device)
    want = torch.zeros_like(ours)
    tk.insert_keys(ours, keys, slots)
    reference.insert_keys(want, keys, slots)
    differ = int((ours != want).sum())
    return {
        "metric": "differing bytes",
        "value": differ,
        "bound": 0,
        "model": "bit-exact",
        "ok": differ == 0,
    }


def indexer_logits_check(case: dict) -> dict:
    """paged_logits vs reference.logits within the kernel's stated error model:
    |diff| <= LOGIT_RTOL * k_scale * sum_h |w_h| sum_d |q_hd k_d| + LOGIT_ATOL."""
    from vllm_mla.ops.sparse_indexer import api as tk
    from vllm_mla.ops.sparse_indexer import reference

    got = tk.paged_logits(
        case["q"],
        case["weights"],
        case["cache"],
        case["tables"],
        case["lengths"],
        max_len=case["context"],
    )
    worst = 0.0
    for i in range(got.shape[0]):
        length = int(case["lengths"][i])
        rows = reference.request_rows(case["tables"][i], length, 64)
        k, ks = reference.read_keys(case["cache"], rows)
        q, w = case["q"][i : i + 1].float(), case["weights"][i : i + 1]
        want = reference.logits(q, w, k, ks)[0]
        scale = torch.einsum("h,hs->s", w[0].abs(), (q[0].abs() @ k.float().abs().T))
        bound = tk.LOGIT_RTOL * ks.float() * scale + tk.LOGIT_ATOL
        over = ((got[i, :length] - want).abs() / bound).max().item() if length else 0.0
        worst = max(worst, float("inf") if over != over else over)
        if length < got.shape[1] and not torch.isneginf(got[i, length:]).all():
            worst = float("inf")  # positions past the length must be -inf
    return {
        "metric": "max diff / bound",
        "value": worst,
        "bound": 1.0,
        "model": "fp32 sum order (LOGIT_RTOL)",
        "ok": worst <= 1.0,
    }


def capture(step, device):
    """Run ``step`` once eagerly (compiles), capture it in a CUDA graph; returns a replay
    that waits for the GPU (tests swap in an eager stand-in to run this on CPU)."""
    step()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay():
        graph.replay()
        torch.cuda.synchronize(device)

    return replay


def indexer_graph_check(t, heads, context, device, rounds=3, topk=None) -> dict:
    """index_topk captured once, replayed on fresh q / weights / lengths / cache / tables
    copied into the captured buffers; each replay must select what the oracle selects."""
    import sparse_indexer as si

    topk = topk or si.TOPK
    case = si.make_case(t, heads, context, device, torch.Generator().manual_seed(5), topk=topk)
    out = torch.empty(t, topk, dtype=torch.int32, device=device)
    replay = capture(lambda: si.ours(case, out), device)
    errors, near = 0, 0
    for seed in range(rounds):
        gen = torch.Generator().manual_seed(100 + seed)
        fresh = si.make_case(t, heads, context, device, gen, topk=topk)
        for name in ("q", "weights", "lengths", "cache", "tables"):
            case[name].copy_(fresh[name])
        out.fill_(-7)
        replay()
        res = si.compare(case, out.clone())
        errors, near = errors + res["errors"], near + res["near_ties"]
    return {
        "metric": "selection errors",
        "value": errors,
        "bound": 0,
        "near_ties": near,
        "model": "identical but near-ties (LOGIT_RTOL)",
        "ok": errors == 0,
    }


def step_indexer(sec: Section, device) -> None:
    import sparse_indexer as si

    torch.manual_seed(0)  # make_case's key values
    gen = torch.Generator().manual_seed(0)
    sec.check(
        "indexer insert",
        lambda: indexer_insert_check(4096 if not DRY else 100, device),
        shape="T4096 keys, shuffled slots" if not DRY else "T100",
    )
    shapes = [(1, 32, 131072), (32, 32, 32768)] if not DRY else [(2, 4, 200)]
    topk = si.TOPK if not DRY else 64
    for t, heads, context in shapes:
        case = si.make_case(t, heads, context, device, gen, topk=topk)
        label = f"T{t} H{heads} ctx {context} K{topk}"
        sec.check("indexer logits", lambda case=case: indexer_logits_check(case), shape=label)

        def topk_check(case=case):
            res = si.compare(case, si.ours(case))
            return {
                "metric": "selection errors",
                "value": res["errors"],
                "bound": 0,
                "near_ties": res["near_ties"],
                "model": "identical but near-ties",
                "ok": res["ok"],
            }

        sec.check("indexer top-k", topk_check, shape=label)
    sec.graph(
        "graph indexer decode",
        lambda: indexer_graph_check(32, 32, 32768, device),
        shape="T32 H32 ctx 32768 K2048",
    )
    bw = None
    if not DRY:
        import common

        bw = common.copy_bandwidth(device)
        sec.data["copy_bandwidth_GBps"] = bw / 1e9
        sec.note(f"HBM copy bandwidth {bw / 1e9:.0f} GB/s (1 GiB device-to-device)")
    for t in (1, 32):
        sec.timing(
            "indexer decode vs HBM",
            lambda t=t: _indexer_timing(t, device, gen, bw),
            shape=f"GLM-5 T{t} H32 ctx 32768 K2048",
        )


# ---------------------------------------------------------------- DeepSeek-V4


def step_dsv4(sec: Section, device) -> None:
    """V4's Triton attention (window + compressed sources, the sink), record writer and
    compressor: decode and prefill shapes against the torch reference, then writer +
    attention under CUDA-graph replay on fresh inputs, then decode time vs the HBM
    roofline."""
    import dsv4_attention as v4

    gen = torch.Generator().manual_seed(0)
    for name, t, h, n_window, n_comp in v4.DRY_SHAPES if DRY else v4.SHAPES:
        sec.check(
            f"dsv4 {name}",
            lambda a=(name, t, h, n_window, n_comp): v4.check(*a, device, gen),
            shape=f"T{t} H{h} window {n_window} + {n_comp}",
        )
    for ratio, coff, width in v4.COMPRESSORS:
        t = 3 if DRY else 1024
        sec.check(
            "dsv4 compressor",
            lambda a=(ratio, coff, width, t): v4.compress_check(*a, device, gen),
            shape=f"T{t} ratio {ratio} D {width}",
        )
    sec.graph(
        "graph dsv4 decode",
        lambda: v4.graph_check(capture, device, gen),
        shape=f"T32 H64 window {v4.WINDOW} + top-{v4.TOPK}, writer + attention",
    )
    bw = None
    if not DRY:
        import common

        bw = common.copy_bandwidth(device)
        sec.data["copy_bandwidth_GBps"] = bw / 1e9
    sec.timing("dsv4 decode vs HBM", lambda: v4.time_decode(device, gen, bw), shape="T32 H64")


def _indexer_timing(t, device, gen, bw, heads=32, context=32768) -> dict:
    import common
    import sparse_indexer as si

    case = si.make_case(t, heads, context, device, gen, topk=min(si.TOPK, context))
    us = common.graph_time_us(lambda: si.ours(case))
    nbytes = int(case["lengths"].sum()) * si.RECORD_BYTES
    roof_us = nbytes / bw * 1e6
    return {
        "ours_us": us,
        "base_us": roof_us,
        "base": "HBM roofline (index-key bytes)",
        "ratio": us / roof_us,
        "key_bytes": nbytes,
        "ok": True,
    }


# ---------------------------------------------------------------- report


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if v == v else "nan"
    return str(v)


def _cell(text: object) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


GRAPH_KEYS = ("worst_rel_err", "fused_max_abs_diff", "safe_rel_err", "rel_err", "lse_err")


def check_cells(r: dict) -> tuple[str, str]:
    """(result, bound with its error model) of one correctness row."""
    if r.get("status") == NOT_RUN:
        return NOT_RUN + " (dry)", "-"
    if "error" in r and "value" not in r:
        return "error: " + r["error"][:160], "-"
    if "metric" in r:
        result = f"{r['metric']} {_fmt(r.get('value'))}"
    else:
        result = ", ".join(f"{k} {_fmt(r[k])}" for k in GRAPH_KEYS if k in r)
    if "error" in r:
        result += f" ({r['error'][:120]})"
    return result, f"{_fmt(r.get('bound', ''))} ({r.get('model', '')})"


def rows_markdown(data: dict) -> str:
    """RESULTS.md-ready: a heading and two tables, each row carrying date, GPU, driver,
    torch, Triton and commit, so rows of several windows can share one table."""
    env = data["env"]
    keys = ("date", "gpu", "driver", "torch", "triton", "commit")
    prefix = "| " + " | ".join(_cell(env.get(k, "?")) for k in keys) + " | "
    where = "DRY RUN on CPU: plumbing only, no GPU figure" if data.get("dry") else env.get("gpu")
    steps = data.get("steps", {})
    lines = [f"## {env.get('date', '?')} — `gpu_check.sh essential`, {where}", ""]
    lines.append(
        "Steps (status, wall s): "
        + ", ".join(
            f"{n} {s.get('status', '?')} ({s.get('wall_s', s.get('seconds', '?'))})"
            for n, s in steps.items()
        )
        + f"; step timeouts sum {data.get('step_timeouts_sum_s', '?')} s."
    )
    lines += [
        "",
        "| date | GPU | driver | torch | Triton | commit | check | shape | result | "
        "bound (error model) | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for step in steps.values():
        for r in step.get("checks", []):
            result, bound = check_cells(r)
            ok = "yes" if r.get("ok") else "NO"
            cells = (r["name"], r.get("shape", ""), result, bound, ok)
            lines.append(prefix + " | ".join(_cell(c) for c in cells) + " |")
    lines += [
        "",
        "| date | GPU | driver | torch | Triton | commit | timing | shape | ours us | "
        "baseline / roofline | baseline us | ours / baseline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for step in steps.values():
        for r in step.get("timings", []):
            if r.get("status") == NOT_RUN:
                cells = [NOT_RUN + " (dry)", "-", "-", "-"]
            elif "error" in r:
                cells = ["error: " + r["error"][:160], "-", "-", "-"]
            else:
                base = (r.get("ours_us"), r.get("base", ""), r.get("base_us"), r.get("ratio"))
                cells = [_fmt(v) for v in base]
            cells = [r["name"], r.get("shape", ""), *cells]
            lines.append(prefix + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def report(out_dir: Path, exits: list[str], budget: str | None, skipped=()) -> int:
    """Merge the shell's view (exit codes, seconds, skipped steps, step timeouts) into
    essential.json, write essential.md, print the tables; 1 if any step did not pass."""
    rep = Report(out_dir)
    steps = rep.data["steps"]
    for item in skipped:  # NAME=REASON: a step the shell did not run (e.g. no GPU)
        name, _, why = item.partition("=")
        steps[name] = {"status": "skipped", "why": why, "checks": [], "timings": []}
    for item in exits:  # NAME=RC:SECONDS from the shell
        name, _, rest = item.partition("=")
        rc_text, _, secs = rest.partition(":")
        rc = int(rc_text) if rc_text.lstrip("-").isdigit() else -1
        s = steps.setdefault(name, {"checks": [], "timings": [], "notes": []})
        s["exit"], s["wall_s"] = rc, float(secs or 0)
        if rc == 124 or rc == 137:
            s["status"] = "timeout"
        elif s.get("status") == "skipped":
            pass
        elif rc != 0 and s.get("status") in (None, "running", "ok", "dry", "failed"):
            s["status"] = f"failed (exit {rc})"
        elif rc == 0 and s.get("status") in (None, "running"):
            s["status"] = "dry" if rep.data.get("dry") else "ok"
    order = ("machine", "build", "memcheck", *STEPS)
    steps = {n: steps[n] for n in order if n in steps} | steps  # the shell's order
    rep.data["steps"] = steps
    if budget:
        pairs = [p.split(":") for p in budget.split()]
        rep.data["step_timeouts_s"] = {n: int(v) for n, v in pairs}
        rep.data["step_timeouts_sum_s"] = sum(int(v) for _, v in pairs)
    rep.save()
    text = rows_markdown(rep.data)
    (out_dir / "essential.md").write_text(text)
    print(text)
    bad = [n for n, s in steps.items() if s.get("status") not in ("ok", "dry", "skipped")]
    print(
        "ESSENTIAL",
        "FAIL: " + ", ".join(bad) if bad else "PASS",
        "(dry run: plumbing only)" if rep.data.get("dry") else "",
    )
    return 1 if bad else 0


def show_machine(out_dir: Path) -> int:
    """The machine step: GPU, driver, versions into essential.json; a version problem is
    printed (naming the versions), never raised."""
    rep = Report(out_dir)
    env = rep.data["env"]
    print(
        ", ".join(
            f"{k} {env.get(k)}"
            for k in ("gpu", "driver", "capability", "python", "torch", "cuda", "triton", "commit")
        )
    )
    print("CUDA device visible to torch:", torch.cuda.is_available(), "| dry run:", DRY)
    problem = version_problem()
    step = {"status": "ok", "checks": [], "timings": [], "notes": []}
    if problem:
        step["status"] = "failed"
        step["notes"].append(f"{problem} (this package needs torch >= 2.11, Triton >= 3.6)")
        print(f"VERSION PROBLEM: {step['notes'][-1]}")
    rep.data["steps"]["machine"] = step
    rep.save()
    return 1 if problem else 0


def run_step(name: str, out_dir: Path) -> int:
    rep = Report(out_dir)
    sec = Section(rep, name)
    problem = version_problem()
    if problem:
        sec.data["status"] = "failed"
        sec.note(f"cannot run: {problem} (this package needs torch >= 2.11, Triton >= 3.6)")
        sec.data["status"] = "failed"
        sec._save()
        return 1
    device = torch.device("cpu" if DRY else "cuda")
    if DRY:
        sec.note("dry run: CPU, Triton interpreter, tiny shapes; CUDA graphs and timings skip")
    try:
        steps = {"query": step_query, "sparse": step_sparse, "indexer": step_indexer}
        steps["dsv4"] = step_dsv4
        steps[name](sec, device)
    except Exception as exc:  # an import or setup error: one line, the step fails
        sec.data["checks"].append(
            {
                "name": f"{name} (setup)",
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}"[:500],
                "trace": traceback.format_exc().splitlines()[-8:],
            }
        )
        print(f"[{name}] error: {type(exc).__name__}: {exc}", flush=True)
    return sec.finish()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=[*STEPS, "machine", "report"])
    parser.add_argument("--out", type=Path, required=True, help="folder of essential.json")
    parser.add_argument(
        "--step",
        action="append",
        default=[],
        dest="exits",
        help="report: NAME=RC:SECONDS of a shell step",
    )
    parser.add_argument("--budget", help="report: 'NAME:TIMEOUT ...' of the shell steps")
    parser.add_argument(
        "--skip", action="append", default=[], help="report: NAME=REASON of a skipped step"
    )
    args = parser.parse_args()
    if args.step == "report":
        return report(args.out, args.exits, args.budget, args.skip)
    if args.step == "machine":
        return show_machine(args.out)
    with contextlib.suppress(Exception):
        torch.backends.cuda.matmul.allow_tf32 = False  # references in true fp32
    return run_step(args.step, args.out)


if __name__ == "__main__":
    sys.exit(main())
