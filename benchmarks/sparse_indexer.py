"""The portable DSA indexer (Triton) at DeepSeek-V3.2 / GLM-5 shapes: selections, graphs, speed.

1. Selections vs the torch oracle (``sparse_indexer.reference``): index heads 64
   (DeepSeek-V3.2) and 32 (GLM-5), head dim 128, top-k 2048, contexts 4k / 32k / 128k
   (ragged within a batch), 64-row pages in shuffled order. A token's selection must be
   the oracle's, except where a candidate swapped at the top-k boundary has a logit
   within the two positions' logit bounds (``LOGIT_RTOL`` of their magnitudes, as
   ``paged_logits`` promises) of the K-th: those are counted and reported
   (``near_ties``), any other difference fails.
2. CUDA graphs: one decode step (T = 8, 32k) captured, replayed with new q / weights /
   lengths copied into the captured buffers; each replay must match the oracle.
3. Speculative-decoding layouts: ``select`` of the portable indexer on native ``[B, 2]``,
   ragged and flattened decode metadata (as vLLM's builder hands them under MTP), each
   token vs the oracle on its own context, CUDA-graph replay on fresh queries.
4. Decode speed: median CUDA-graph replay of ``index_topk`` (logits + top-k) at T in
   {1, 32, 64}, context 32k and 128k; index-key bytes read = sum of lengths x 132 over
   the copy bandwidth measured in the same run -> % roofline. Where vLLM's DeepGEMM
   indexer runs (Hopper, Blackwell), its decode (``fp8_fp4_paged_mqa_logits`` +
   vLLM's top-k dispatcher) is timed the same way, side by side: ratio ours / vLLM.

    python benchmarks/sparse_indexer.py --out $OUT/sparse_indexer.json   # GPU, ~3 min H200
    python benchmarks/sparse_indexer.py --smoke --out /tmp/i.json         # CPU, interpreter
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, environment, graph_time_us

from vllm_mla.ops.sparse_indexer import RECORD_BYTES, reference
from vllm_mla.ops.sparse_indexer import api as tk

BLOCK = 64
TOPK = 2048


def make_case(t: int, heads: int, context: int, device, gen, *, topk: int = TOPK) -> dict:
    """T tokens of T requests (ragged lengths up to ``context``), their keys in a paged
    cache whose pages are shuffled (block tables are permutations)."""
    blocks_per_req = -(-context // BLOCK)
    num_blocks = t * blocks_per_req
    cache = torch.zeros(num_blocks, BLOCK, RECORD_BYTES, dtype=torch.uint8, device=device)
    perm = torch.randperm(num_blocks, generator=gen, device="cpu").to(device)
    tables = perm.view(t, blocks_per_req).to(torch.int32)
    lengths = torch.randint(context // 2, context + 1, (t,), generator=gen, device="cpu")
    lengths[0] = context
    lengths = lengths.to(device=device, dtype=torch.int32)
    slots = (tables.long()[:, :, None] * BLOCK + torch.arange(BLOCK, device=device)).view(-1)
    for start in range(0, slots.numel(), 1 << 16):
        part = slots[start : start + (1 << 16)]
        keys = torch.randn(part.numel(), 128, device=device)  # torch.manual_seed in main
        tk.insert_keys(cache, keys, part)
    q = (torch.randn(t, heads, 128, generator=gen, device="cpu") * 2).to(device)
    weights = torch.rand(t, heads, generator=gen, device="cpu").to(device) / heads**0.5
    return {
        "cache": cache,
        "tables": tables,
        "lengths": lengths,
        "q": q.to(torch.float8_e4m3fn),
        "weights": weights,
        "topk": topk,
        "context": context,
    }


def compare(case: dict, got: torch.Tensor) -> dict:
    """Per token: the oracle's selection vs ``got``; differences explained by a boundary
    near-tie (within the logit bounds of the K-th) are counted, others are errors."""
    errors, near = 0, 0
    cache, q, w = case["cache"], case["q"].float(), case["weights"]
    for i in range(got.shape[0]):
        length = int(case["lengths"][i])
        rows = reference.request_rows(case["tables"][i], length, BLOCK)
        k, ks = reference.read_keys(cache, rows)
        logits = reference.logits(q[i : i + 1], w[i : i + 1], k, ks)[0]
        want = reference.select_topk(logits[None], case["lengths"][i : i + 1], case["topk"])[0]
        if torch.equal(got[i], want):
            continue
        last = int(want[want >= 0][-1]) if (want >= 0).any() else 0
        kth = logits[last].item()
        mine = set(got[i][got[i] >= 0].tolist())
        theirs = set(want[want >= 0].tolist())
        swapped = list(mine ^ theirs)
        # LOGIT_RTOL's model: per position, of k_scale * sum_h |w_h| sum_d |q_hd k_d| (the
        # dots cancel, so |logit| itself can be ~10x smaller); both logits may move.
        magnitude = reference.logits(q[i : i + 1].abs(), w[i : i + 1].abs(), k.float().abs(), ks)
        bound = tk.LOGIT_RTOL * magnitude[0] + tk.LOGIT_ATOL
        if (
            len(mine) == len(theirs)
            and swapped
            and all(abs(logits[j].item() - kth) <= bound[j] + bound[last] for j in swapped)
        ):
            near += 1
        else:
            errors += 1
    return {"errors": errors, "near_ties": near, "ok": errors == 0}


def ours(case: dict, out: torch.Tensor | None = None) -> torch.Tensor:
    return tk.index_topk(
        case["q"],
        case["weights"],
        case["cache"],
        case["tables"],
        case["lengths"],
        case["topk"],
        max_len=case["context"],
        out=out,
    )


def vllm_decode(case: dict):
    """vLLM's DeepGEMM decode indexer on the same step, or (None, why)."""
    try:
        from vllm.model_executor.layers.sparse_attn_indexer import get_indexer_topk
        from vllm.utils.deep_gemm import (
            fp8_fp4_paged_mqa_logits,
            get_num_sms,
            get_paged_mqa_logits_metadata,
            is_deep_gemm_supported,
        )
    except Exception as exc:  # vLLM absent or another version
        return None, f"vLLM's indexer functions do not import: {exc}"
    if not is_deep_gemm_supported():
        return None, "DeepGEMM is not supported on this GPU"
    t = case["q"].shape[0]
    lens = case["lengths"].view(t, 1)
    sched = get_paged_mqa_logits_metadata(lens, BLOCK, get_num_sms())
    cache = case["cache"].view(case["cache"].shape[0], BLOCK, 1, RECORD_BYTES)
    q = case["q"].view(t, 1, *case["q"].shape[1:])
    out = torch.full((t, case["topk"]), -1, dtype=torch.int32, device=q.device)
    topk = get_indexer_topk("auto")

    def step():
        logits = fp8_fp4_paged_mqa_logits(
            (q, None), cache, case["weights"], lens, case["tables"], sched, case["context"]
        )
        topk(logits, lens, 1, out, case["topk"], case["context"])
        return out

    try:
        step()
    except Exception as exc:
        return None, f"vLLM's decode indexer failed here: {type(exc).__name__}: {exc}"[:300]
    return step, ""


def layout_step(case: dict, layout: str, next_n: int):
    """The decode metadata vLLM's indexer builder hands the indexer for ``case``'s T tokens
    read as requests of ``next_n`` speculative tokens: ``native`` ([B, next_n] context
    lengths), ``ragged`` (requires_padding: every other request one token short, packed)
    or ``flat`` (one row per token, tables expanded). Returns (layer, metadata, the case
    reduced to the tokens the layout holds, each with its own table row and length)."""
    from types import SimpleNamespace

    t = case["q"].shape[0]
    requests = t // next_n
    lens = torch.full((requests,), next_n, dtype=torch.int32)
    if layout == "ragged":
        lens[1::2] = next_n - 1
    keep = torch.cat([torch.arange(r * next_n, r * next_n + int(d)) for r, d in enumerate(lens)])
    # each request's keys: its first token's table; token i of d sees L - d + 1 + i keys
    req_of = torch.repeat_interleave(torch.arange(requests), lens.long())
    first = torch.cumsum(lens, 0) - lens
    total = case["lengths"].cpu()[torch.arange(requests) * next_n].long()
    per_token = total[req_of] - lens[req_of] + 1 + (torch.arange(len(keep)) - first[req_of])
    device = case["q"].device
    tables = case["tables"][(torch.arange(requests) * next_n).to(device)]
    seq = (total[:, None] - next_n + 1 + torch.arange(next_n)).to(torch.int32).to(device)
    if layout == "flat":
        decode = SimpleNamespace(
            requires_padding=False,
            seq_lens=per_token.to(torch.int32).to(device),
            block_table=tables[req_of.to(device)],
            decode_lens=torch.ones(len(keep), dtype=torch.int32, device=device),
        )
    else:
        decode = SimpleNamespace(
            requires_padding=layout == "ragged",
            seq_lens=seq,
            block_table=tables,
            decode_lens=lens.to(device),
        )
    meta = SimpleNamespace(
        num_decodes=requests,
        num_decode_tokens=len(keep),
        decode=decode,
        num_prefills=0,
        prefill=None,
        max_seq_len=int(total.max()),
        slot_mapping=torch.full((len(keep),), -1, dtype=torch.int64, device=device),
    )
    layer = SimpleNamespace(
        k_cache=SimpleNamespace(kv_cache=case["cache"]),
        scale_fmt="ue8m0",
        topk_tokens=case["topk"],
        topk_indices_buffer=torch.full(
            (len(keep) + 1, case["topk"]), -7, dtype=torch.int32, device=device
        ),
    )
    keep_d = keep.to(device)
    reduced = {
        **case,
        "q": case["q"][keep_d],
        "weights": case["weights"][keep_d],
        "tables": tables[req_of.to(device)],
        "lengths": per_token.to(torch.int32).to(device),
    }
    return layer, meta, reduced


def decode_layouts(case: dict, graphs: bool) -> list[dict]:
    """The portable indexer's ``select`` (Triton kernels) on every decode layout vLLM's
    builder produces under speculative decoding (MTP): native next_n 2, ragged next_n 2,
    flattened next_n 4; each token's selection vs the oracle on its own context. With
    ``graphs``: ``select`` captured once per layout and replayed on fresh queries."""
    from vllm_mla.vllm.sparse import indexer

    rows = []
    for layout, next_n in (("native", 2), ("ragged", 2), ("flat", 4)):
        layer, meta, reduced = layout_step(case, layout, next_n)
        t = reduced["q"].shape[0]
        hidden = torch.empty(t, 1, device=reduced["q"].device)  # only its length is read

        def step(layer=layer, meta=meta, reduced=reduced, hidden=hidden):
            return indexer.select(
                layer,
                hidden,
                reduced["q"],
                None,
                reduced["weights"],
                meta,
                tk,
                max_decode_len=reduced["context"],
            )

        got = step()[:t].clone()
        row = {"layout": layout, "next_n": next_n, "T": t, **compare(reduced, got)}
        if graphs:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            fresh = (torch.randn_like(reduced["q"].float()) * 2).to(reduced["q"].dtype)
            reduced["q"].copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            replay = compare(reduced, layer.topk_indices_buffer[:t].clone())
            row["graph_replay_ok"] = replay["ok"]
            row["ok"] = row["ok"] and replay["ok"]
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    report: dict = {"env": environment(), "checks": [], "graph": [], "timing": []}
    if args.smoke:
        device = torch.device("cpu")
        gen = torch.Generator().manual_seed(0)
        for t, heads, context in ((2, 4, 200), (3, 32, 130)):
            case = make_case(t, heads, context, device, gen, topk=64)
            row = {"T": t, "H": heads, "context": context, **compare(case, ours(case))}
            report["checks"].append(row)
        case = make_case(8, 4, 150, device, gen, topk=32)
        report["layouts"] = decode_layouts(case, graphs=False)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        gen = torch.Generator().manual_seed(0)
        bw = copy_bandwidth(device)
        report["copy_bandwidth_GBps"] = bw / 1e9
        for heads in (64, 32):
            for t, context in ((1, 131072), (8, 32768), (32, 4096)):
                case = make_case(t, heads, context, device, gen)
                row = {"T": t, "H": heads, "context": context, **compare(case, ours(case))}
                report["checks"].append(row)
                print(row, flush=True)
        # graph replay with changing inputs
        case = make_case(8, 64, 32768, device, gen)
        out = torch.empty(8, TOPK, dtype=torch.int32, device=device)
        ours(case, out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ours(case, out)
        for seed in range(3):
            fresh = make_case(8, 64, 32768, device, torch.Generator().manual_seed(100 + seed))
            for name in ("q", "weights", "lengths"):
                case[name].copy_(fresh[name])
            case["cache"].copy_(fresh["cache"])
            case["tables"].copy_(fresh["tables"])
            graph.replay()
            torch.cuda.synchronize()
            report["graph"].append({"replay": seed, **compare(case, out.clone())})
        print(report["graph"], flush=True)
        # speculative-decoding (MTP) decode layouts, GLM-5 TP4-like: 32 index heads
        report["layouts"] = decode_layouts(make_case(32, 32, 16384, device, gen), graphs=True)
        for context in (32768, 131072):
            for t in (1, 32, 64):
                case = make_case(t, 64, context, device, gen)
                us = graph_time_us(lambda case=case: ours(case))
                nbytes = int(case["lengths"].sum()) * RECORD_BYTES
                row = {"T": t, "H": 64, "context": context, "ours_us": us, "key_bytes": nbytes}
                row["pct_roofline"] = 100 * nbytes / (us * 1e-6) / bw
                step, why = vllm_decode(case)
                if step is not None:
                    row["vllm_us"] = graph_time_us(step)
                    row["ours_over_vllm"] = us / row["vllm_us"]
                else:
                    row["vllm"] = why
                report["timing"].append(row)
                print(row, flush=True)
    report["seconds"] = time.perf_counter() - started
    checked = report["checks"] + report["graph"] + report.get("layouts", [])
    report["ok"] = all(c["ok"] for c in checked)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("PASS" if report["ok"] else "FAIL", f"({report['seconds']:.1f} s)")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
