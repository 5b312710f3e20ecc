"""Compile every @triton.jit kernel of vllm_mla for a GPU target with the installed Triton
and its bundled ptxas (no GPU needed): registers, shared memory, spills, compile time.

The cases are the constexpr sets and pointer types the launchers use on a GPU:
absorbed bmm (MXFP8 W_UK_T / W_UV views, every M bucket), fused query projection (BF16 /
MXFP8 weight, BF16 / FP8 out, P 128 / 192), sparse MLA split (both cache formats, direct and
split, both head tiles) and combine, indexer insert and paged logits (e4m3 / bf16 q, both
head tiles), DeepSeek-V4's record writer, compressor and attention. Fails on: a compile
error, > 255 registers, shared memory over the target's opt-in limit per block. Spill
stores / loads (``ptxas -v`` with Triton's bundled ptxas) and the stack frame are reported
as a performance note, not a failure.

    python benchmarks/essential_aot.py [--arch 90 [--arch 120 ...]] [--json out.json]

scripts/device_preflight.sh runs it with the GPU image's Triton (3.6) for sm_90.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels cannot be compiled
# An empty cache of our own (removed at exit): compile times are real, and nothing else's
# cache is touched.
if "TRITON_CACHE_DIR" not in os.environ:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="essential_aot_")
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], True)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_mla.formats import ROPE
from vllm_mla.ops.absorbed_matmul import kernel as bmm_kernel
from vllm_mla.ops.absorbed_matmul.kernel import absorbed_bmm_kernel
from vllm_mla.ops.dsv4 import triton_kernels as v4
from vllm_mla.ops.query_projection import kernel as qp_kernel
from vllm_mla.ops.query_projection.kernel import mla_query_projection_kernel
from vllm_mla.ops.sparse_indexer import triton_kernels as ik
from vllm_mla.ops.sparse_mla import triton_kernels as sk

# Opt-in shared memory per block: sm80 163 KiB, sm86/89 99 KiB, sm90/100 227 KiB,
# sm120 99 KiB (CUDA C programming guide, compute capabilities table).
SHARED_LIMIT = {80: 163 << 10, 86: 99 << 10, 89: 99 << 10, 90: 227 << 10, 100: 227 << 10}
SHARED_LIMIT[120] = 99 << 10
MAX_REGS = 255
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _aligned_attrs(sig: dict, aligned: set[str]) -> dict:
    """tt.divisibility 16 on every pointer and on the integer arguments in ``aligned``
    (what a launch with 16-byte aligned tensors and strides specializes on)."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(sig)
        if n.endswith("_ptr") or n in aligned
    }


def absorbed_bmm_cases() -> list[dict]:
    """MXFP8 views as the direct mode launches them (dense weights never reach Triton on
    CUDA): W_UK_T [H, P, 512] scales along N, W_UV [H, 512, V] scales along K."""
    strides = ["s_ab", "s_am", "s_ak", "s_wb", "s_wk", "s_wn", "s_sb", "s_sk", "s_sn"]
    strides += ["s_ob", "s_om", "s_on"]
    cases = []
    for role, k, n, along_k in [
        ("W_UK_T", 128, 512, False),
        ("W_UK_T", 192, 512, False),
        ("W_UV", 512, 128, True),
        ("W_UV", 512, 256, True),
    ]:
        for m in (1, 32, 64):
            block_m, block_n, block_k = bmm_kernel.tiles(m, n, k, False)
            sig = {"a_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*u8", "o_ptr": "*bf16"}
            sig.update({"M": "i32", **{s: "i32" for s in strides}})
            const = dict(
                N=n,
                K=k,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_K=block_k,
                MXFP8=True,
                SCALE_ALONG_K=along_k,
                FP32_IN=False,
                OUT_BF16=True,
                INTERPRET=False,
            )
            cases.append(
                dict(
                    kernel="absorbed_bmm",
                    fn=absorbed_bmm_kernel,
                    what=f"{role} K={k} N={n} M<={block_m}",
                    sig=sig,
                    const=const,
                    attrs=_aligned_attrs(sig, set()),
                    options=dict(num_warps=4),
                )
            )
    return cases


def query_projection_cases() -> list[dict]:
    cases = []
    for p in (128, 192):
        for mx in (False, True):
            for fp8_out in (False, True):
                for m in (1, 32, 64):
                    block_m, block_l = qp_kernel.tiles(m, 512, False)
                    w = "*fp8e4nv" if mx else "*bf16"
                    sig = {
                        "q_ptr": "*bf16",
                        "w_ptr": w,
                        "s_ptr": "*u8" if mx else w,
                        "pe_ptr": "*bf16",
                        "out_ptr": "*fp8e4nv" if fp8_out else "*bf16",
                        "q_scale_ptr": "*fp32" if fp8_out else "*bf16",
                    }
                    sig.update({s: "i32" for s in ("M", "s_qm", "s_qh", "s_wh", "s_wk")})
                    sig.update({s: "i32" for s in ("s_sh", "s_sk", "s_pm", "s_ph", "s_om")})
                    sig["s_oh"] = "i32"
                    const = dict(
                        P=p,
                        L=512,
                        R=64,
                        BLOCK_M=block_m,
                        BLOCK_K=qp_kernel.BLOCK_K,
                        BLOCK_L=block_l,
                        MXFP8=mx,
                        FP8_OUT=fp8_out,
                        INTERPRET=False,
                    )
                    cases.append(
                        dict(
                            kernel="query_projection",
                            fn=mla_query_projection_kernel,
                            what=f"P={p} {'mxfp8' if mx else 'bf16'} -> "
                            f"{'e4m3' if fp8_out else 'bf16'} M<={block_m}",
                            sig=sig,
                            const=const,
                            attrs=_aligned_attrs(sig, {"s_pm", "s_ph", "s_om", "s_oh"}),
                            options=dict(num_warps=4),
                        )
                    )
    return cases


def sparse_mla_cases(arch: int) -> list[dict]:
    """The split kernel at both head tiles (H 16 -> 16, H 128 -> 32 heads per program),
    split (partials into scratch) and direct, plus the combine kernel."""
    ints = ["m_off", "l_off", "T", "H", "K", "split_len", "block_size", "num_rows"]
    strides = ["s_qn_t", "s_qn_h", "s_qp_t", "s_qp_h", "s_kv_b", "s_kv_t", "s_idx", "s_o_t"]
    strides += ["s_o_h", "s_lse_t"]
    aligned = {"s_bt", "H", "block_size", "s_qn_t", "s_qn_h", "s_qp_t", "s_qp_h", "s_kv_b"}
    aligned |= {"s_kv_t", "s_o_t", "s_o_h"}
    cases = []
    for fmt in ("fp8_ds_mla", "bf16"):
        fp8 = fmt == "fp8_ds_mla"
        for heads in (16, 128):
            bh = sk.block_h(heads)
            for direct in (False, True):
                sig = {
                    "qn_ptr": "*bf16",
                    "qp_ptr": "*bf16",
                    "kv_ptr": "*u8" if fp8 else "*bf16",
                    "idx_ptr": "*i32",
                    "len_ptr": "*i32",
                    "out_ptr": "*bf16" if direct else "*u8",
                    "lse_ptr": "*fp32" if direct else "*u8",
                    "l_ptr": "*bf16" if direct else "*u8",
                    "err_ptr": "*i32",
                    "sink_ptr": "*fp32",
                    "req_ptr": "*i32",
                    "bt_ptr": "*i32",
                    "s_bt": "i32",
                    "bt_width": "i32",
                    "dcp_period": "i32",
                    "dcp_start": "i32",
                    "dcp_interleave": "i32",
                    **{n: "i32" for n in ints},
                    "qk_scale": "fp32",
                    **{n: "i32" for n in strides},
                }
                const = dict(
                    FP8=fp8,
                    HAS_LENGTHS=True,
                    DIRECT=direct,
                    WRITE_LSE=True,
                    HAS_ERR=True,
                    LOGICAL=True,
                    DCP=False,
                    SINK=direct,  # the sink is folded into the direct epilogue only
                    ROPE=ROPE,  # the DSA geometry (rope 0 compiles in tests/test_sparse_mla.py)
                    BLOCK_H=bh,
                    BLOCK_K=sk.BLOCK_K,
                    INTERPRET=False,
                )
                stages = sk.num_stages(arch // 10, fp8, bh)
                cases.append(
                    dict(
                        kernel="sparse_mla_split",
                        fn=sk._sparse_mla_split_kernel,
                        what=(f"{fmt} {bh} heads/program {'direct, sink' if direct else 'split'}"),
                        sig=sig,
                        const=const,
                        attrs=_aligned_attrs(sig, aligned),
                        options=dict(num_warps=sk.NUM_WARPS, num_stages=stages),
                    )
                )
    for lse in (True, False):
        sig = {"scratch_ptr": "*u8", "m_off": "i32", "l_off": "i32", "out_ptr": "*bf16"}
        sig.update({"lse_ptr": "*fp32" if lse else "*bf16", "sink_ptr": "*fp32"})
        sig.update({"H": "i32", "num_splits": "i32"})
        sig.update({"s_o_t": "i32", "s_o_h": "i32", "s_lse_t": "i32"})
        cases.append(
            dict(
                kernel="sparse_mla_combine",
                fn=sk._sparse_mla_combine_kernel,
                what=f"lse {'written, sink' if lse else 'not written'}",
                sig=sig,
                const=dict(WRITE_LSE=lse, SINK=lse, INTERPRET=False),
                attrs=_aligned_attrs(sig, {"H", "s_o_t", "s_o_h"}),
                options=dict(num_warps=sk.NUM_WARPS),
            )
        )
    return cases


def indexer_cases() -> list[dict]:
    aligned = {"block_size", "s_kt", "s_page", "s_qt", "s_qh", "s_wt", "s_bt", "s_ot"}
    sig = {"k_ptr": "*bf16", "slot_ptr": "*i64", "cache_ptr": "*u8"}
    sig.update({n: "i32" for n in ("T", "num_rows", "block_size", "s_kt", "s_kd", "s_page")})
    cases = [
        dict(
            kernel="indexer_insert",
            fn=ik._insert_keys_kernel,
            what="bf16 keys, ue8m0 scales",
            sig=sig,
            const=dict(UE8M0=True, BLOCK_T=ik.INSERT_BLOCK_T),
            attrs=_aligned_attrs(sig, aligned),
            options=dict(num_warps=ik.NUM_WARPS),
        )
    ]
    for q_fp8 in (True, False):
        for heads in (16, 64):  # the two head tiles the launcher uses (16 and 32 per dot)
            bh = ik._block_h(heads)
            sig = {
                "q_ptr": "*u8" if q_fp8 else "*bf16",
                "w_ptr": "*fp32",
                "cache_ptr": "*u8",
                "bt_ptr": "*i32",
                "len_ptr": "*i32",
                "out_ptr": "*fp32",
            }
            names = ("H", "S", "bt_width", "num_blocks", "block_size", "s_qt", "s_qh", "s_wt")
            sig.update({n: "i32" for n in (*names, "s_bt", "s_page", "s_ot")})
            cases.append(
                dict(
                    kernel="indexer_logits",
                    fn=ik._paged_logits_kernel,
                    what=f"q {'e4m3' if q_fp8 else 'bf16'}, H={heads} ({bh} per dot)",
                    sig=sig,
                    const=dict(Q_FP8=q_fp8, BLOCK_H=bh, BLOCK_N=ik.BLOCK_N, INTERPRET=False),
                    attrs=_aligned_attrs(sig, aligned),
                    options=dict(num_warps=ik.NUM_WARPS, num_stages=1),
                )
            )
    return cases


def dsv4_cases() -> list[dict]:
    """DeepSeek-V4's record writer (both rules), compressor (C4 and C128 main entries, C4
    indexer keys) and attention (16 heads a program)."""
    sig = {"rows_ptr": "*bf16", "slot_ptr": "*i64", "cache_ptr": "*u8"}
    sig.update({n: "i32" for n in ("s_rt", "s_page", "block_size")})
    cases = [
        dict(
            kernel="dsv4_write",
            fn=v4._dsv4_write_kernel,
            what=f"bf16 rows, {'vLLM CPU' if cpu else 'Triton'} rule",
            sig=sig,
            const=dict(CPU_RULE=cpu),
            attrs=_aligned_attrs(sig, {"s_page"}),
            options=dict(num_warps=v4.WRITE_WARPS),
        )
        for cpu in (True, False)
    ]
    sig = {"state_ptr": "*fp32", "gather_ptr": "*i32", "pos_ptr": "*i64", "weight_ptr": "*fp32"}
    sig.update({"cos_sin_ptr": "*fp32", "out_ptr": "*fp32"})
    sig.update({n: "i32" for n in ("state_block", "s_page", "s_row", "s_gather", "s_cs")})
    sig.update({"s_out": "i32", "eps": "fp32"})
    aligned = {"s_page", "s_row", "s_cs", "s_out"}
    for ratio, window, width in ((4, 8, 512), (128, 128, 512), (4, 8, 128)):
        cases.append(
            dict(
                kernel="dsv4_compress",
                fn=v4._dsv4_compress_kernel,
                what=f"ratio {ratio}, window {window}, D {width}",
                sig=sig,
                const=dict(RATIO=ratio, WINDOW=window, D=width, BLOCK_D=v4.COMPRESS_BLOCK_D),
                attrs=_aligned_attrs(sig, aligned),
                options=dict(num_warps=v4.COMPRESS_WARPS),
            )
        )
    ints = ("T", "H", "n_window", "n_comp", "w_block", "c_block", "s_w_page", "s_c_page")
    ints += ("s_qt", "s_qh", "s_wt", "s_ct", "s_ot", "s_oh")
    sig = {"q_ptr": "*bf16", "window_ptr": "*u8", "w_slot_ptr": "*i32", "comp_ptr": "*u8"}
    sig.update({"c_slot_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16"})
    sig.update({n: "i32" for n in ints})
    sig["qk_scale"] = "fp32"
    aligned = {"H", "s_w_page", "s_c_page", "s_qt", "s_qh", "s_ot", "s_oh"}
    for heads in (64,):  # V4-Flash's 64 heads at TP 1; every H runs the same variant
        bh = v4.block_h(heads)
        cases.append(
            dict(
                kernel="dsv4_attend",
                fn=v4._dsv4_attend_kernel,
                what=f"H={heads} ({bh} a program, {v4.BLOCK_K} records a step)",
                sig=sig,
                const=dict(BLOCK_H=bh, BLOCK_K=v4.BLOCK_K, INTERPRET=False),
                attrs=_aligned_attrs(sig, aligned),
                options=dict(num_warps=v4.NUM_WARPS, num_stages=v4.NUM_STAGES),
            )
        )
    return cases


def cases_for(arch: int) -> list[dict]:
    return [
        *absorbed_bmm_cases(),
        *query_projection_cases(),
        *sparse_mla_cases(arch),
        *indexer_cases(),
        *dsv4_cases(),
    ]


def ptxas_usage(ptx: str) -> dict:
    """``ptxas -v`` on the kernel's PTX: registers, stack frame, spill stores / loads. Triton
    ships one ptxas per PTX generation (``ptxas``, ``ptxas-blackwell``): the first that
    accepts the PTX answers. {} when none does."""
    target = next(line.split()[1] for line in ptx.splitlines() if line.startswith(".target"))
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
        f.write(ptx)
        f.flush()
        for ptxas in sorted(BIN.glob("ptxas*")):
            done = subprocess.run(
                [str(ptxas), "-v", "--gpu-name", target, f.name, "-o", os.devnull],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode == 0:
                return _parse_ptxas(done.stdout + done.stderr)
    return {}


def _parse_ptxas(text: str) -> dict:
    """'Used 72 registers', '16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads'."""
    words = text.replace(",", " ").split()
    usage = {}
    for i, w in enumerate(words):
        if w == "Used" and i + 2 < len(words) and words[i + 2] == "registers":
            usage["reg"] = int(words[i + 1])
        if w == "bytes" and i + 2 < len(words):
            key = {"stack": "stack", "spill": f"spill_{words[i + 2]}"}.get(words[i + 1])
            if key and words[i - 1].isdigit():
                usage[key] = int(words[i - 1])
    return usage


def compile_case(case: dict, arch: int) -> dict:
    """Lower one case to cubin for ``sm_<arch>``; the report row (never raises)."""
    sig = dict(case["sig"])
    sig.update({c: "constexpr" for c in case["const"]})
    row = {"arch": arch, "kernel": case["kernel"], "case": case["what"]}
    start = time.perf_counter()
    try:
        compiled = triton.compile(
            ASTSource(case["fn"], sig, case["const"], case["attrs"]),
            target=GPUTarget("cuda", arch, 32),
            options=case["options"],
        )
    except Exception as exc:
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-600:]}")
        row["seconds"] = time.perf_counter() - start
        return row
    row["seconds"] = time.perf_counter() - start
    row["shared"] = compiled.metadata.shared
    row.update(ptxas_usage(compiled.asm["ptx"]))
    problems = []
    if row["shared"] > SHARED_LIMIT.get(arch, 99 << 10):
        problems.append(f"shared {row['shared']} B > {SHARED_LIMIT.get(arch, 99 << 10)}")
    if row.get("reg", 0) > MAX_REGS:
        problems.append(f"{row['reg']} registers")
    if "reg" not in row:
        problems.append("ptxas -v gave no report")
    if row.get("spill_stores", 0) + row.get("spill_loads", 0):
        # A performance note, not a failure: the window's timings say what it costs.
        row["warning"] = f"spills {row['spill_stores']} B stored, {row['spill_loads']} B loaded"
    row["ok"] = not problems
    if problems:
        row["error"] = "; ".join(problems)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", help="default: 90")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--kernel", action="append", help="only these kernels")
    args = parser.parse_args()
    archs = args.arch or [90]
    print(f"Triton {triton.__version__}; compile time per case with an empty Triton cache")
    head = f"{'arch':>4} {'kernel':<20} {'case':<38} {'regs':>4} {'stack':>5} {'spill':>5}"
    print(head + f" {'shared':>7} {'s':>5}")
    rows = []
    for arch in archs:
        for case in cases_for(arch):
            if args.kernel and case["kernel"] not in args.kernel:
                continue
            row = compile_case(case, arch)
            rows.append(row)
            print(
                f"{arch:>4} {row['kernel']:<20} {row['case']:<38} {row.get('reg', '-'):>4} "
                f"{row.get('stack', '-'):>5} "
                f"{row.get('spill_stores', 0) + row.get('spill_loads', 0):>5} "
                f"{row.get('shared', '-'):>7} {row['seconds']:5.1f}"
                + ("" if row["ok"] else f"  FAIL {row['error']}")
                + (f"  WARN {row['warning']}" if "warning" in row else ""),
                flush=True,
            )
    bad = [r for r in rows if not r["ok"]]
    total = sum(r["seconds"] for r in rows)
    print(f"{len(rows) - len(bad)}/{len(rows)} kernels compile within limits ({total:.0f} s)")
    spills = [r for r in rows if "warning" in r]
    if spills:
        print(f"{len(spills)} spill (a performance note, not a failure):")
        for r in spills:
            print(
                f"  sm_{r['arch']} {r['kernel']} {r['case']}: {r['reg']} registers, {r['warning']}"
            )
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
