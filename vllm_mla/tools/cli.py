"""The ``vllm-mla`` command line.

Exit codes: 0 every applicable check passed; 1 a check failed; 2 the command
could not run (bad preset, TP, device, checkpoint...), with a one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Iterator, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from vllm_mla.geometry import PRESETS, GeometryError
from vllm_mla.kv_capacity import DSA_INDEX_BYTES, capacity
from vllm_mla.tools import tiny_deepseekv4, tiny_glm5next
from vllm_mla.tools.checkpoint import CheckpointError
from vllm_mla.tools.plot import PlotError, check_plot, write_plot
from vllm_mla.tools.qualify import (
    QualifyConfig,
    QualifyError,
    failed_checks,
    plain_progress,
    run_qualify,
)
from vllm_mla.tools.soak import SoakConfig, run_soak
from vllm_mla.tools.standins import WEIGHT_FORMATS
from vllm_mla.tools.tinymodel import (
    ARCHS,
    EXACT_GRIDS,
    KV_B_FORMATS,
    MakeModelError,
    TinyModelSpec,
    make_model,
)
from vllm_mla.weights import LifecycleError, SourceError

MIB = 1 << 20
USAGE_ERRORS = (
    GeometryError,
    QualifyError,
    CheckpointError,
    SourceError,
    LifecycleError,
    MakeModelError,
    PlotError,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"vllm-mla: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vllm-mla", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("qualify", help="baseline vs lean absorbed weights, per TP rank")
    q.add_argument("--preset", default="glm-5", help=f"one of {', '.join(PRESETS)}")
    q.add_argument(
        "--model", help="a model folder: geometry from config.json, kv_b_proj from its weights"
    )
    q.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="activation dtype served (default bfloat16)",
    )
    q.add_argument("--tp", type=int, default=4, help="tensor-parallel size (default 4)")
    q.add_argument("--rank", type=int, default=0, help="TP rank to report (default 0)")
    q.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        metavar="FORM",
        help="kv_b_proj form, a row of the README's matrix (default: mxfp8-flashinfer; with "
        f"--checkpoint, vLLM's default form for its format); one of {', '.join(WEIGHT_FORMATS)}",
    )
    q.add_argument("--layers", type=int, help="first K layers only (default: all)")
    q.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    q.add_argument("--checkpoint", help="safetensors file or folder holding kv_b_proj tensors")
    q.add_argument("--mha-prefill", action="store_true", help="a dense MHA prefill backend")
    q.add_argument("--no-release", action="store_true", help="keep the source after absorption")
    q.add_argument(
        "--absorbed",
        default="bf16",
        choices=("bf16", "direct"),
        help="absorbed weights: the lean BF16 pair (default) or direct MXFP8 views of the pack",
    )
    q.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    q.add_argument("--max-scratch-mib", type=float, default=8.0, help="dequant scratch bound")
    q.add_argument("--json", action="store_true", help="print the schema-1 JSON report only")
    q.add_argument(
        "--plot",
        metavar="FILE",
        help="also draw live bytes over post-load, baseline and lean (.png, .svg or .pdf; "
        "needs the plot extra)",
    )
    m = sub.add_parser(
        "make-model", help="write a tiny DeepSeek-V2/V3.2-style MLA model (no downloads)"
    )
    m.add_argument("path", help="folder to write (created; files in it are overwritten)")
    m.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default 2; deepseek-v4: 4)"
    )
    m.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    m.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    m.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    m.add_argument("--seed", type=int, default=0, help="weight and tokenizer seed (default 0)")
    m.add_argument("--init-std", type=float, default=0.15, help="weight std (default 0.15)")
    m.add_argument("--kv-b-format", default="fp32", choices=KV_B_FORMATS, help="kv_b_proj storage")
    m.add_argument(
        "--kv-b-exact",
        nargs="?",
        const="fp8-block",
        default=False,
        choices=EXACT_GRIDS,
        help="fp32 kv_b_proj values that this format represents exactly (default fp8-block)",
    )
    m.add_argument(
        "--sparse",
        action="store_true",
        help="DeepSeek-V3.2 (DSA) architecture: q LoRA and a lightning indexer per layer",
    )
    m.add_argument("--q-lora-rank", type=int, default=128, help="with --sparse (default 128)")
    m.add_argument("--index-topk", type=int, default=32, help="with --sparse (default 32)")
    m.add_argument("--index-heads", type=int, default=32, help="with --sparse (default 32)")
    m.add_argument(
        "--mtp-layers",
        type=int,
        default=0,
        help="with --sparse or --arch hy-v4: multi-token-prediction layers for speculative "
        "decoding (default 0)",
    )
    m.add_argument(
        "--arch",
        default="deepseek",
        choices=ARCHS,
        help="deepseek (default: DeepSeek-V2, or V3.2 with --sparse), hy-v4 (HY-V4: DSA with "
        "shared indexers, a learnable attention sink, iHC, gated MLA, MoE) or glm5-next "
        "(GLM-5.3-Flash's text model: MLA of latent 512 without RoPE, the kpool indexer, every "
        "layer MLA unless --kda) or deepseek-v4 (DeepSeek-V4: head 512 with a sliding window, C4 "
        "indexed and C128 compressed layers, a sink, mHC, hash and score-routed MoE); "
        "--q-lora-rank, --index-topk and --index-heads apply to all of them",
    )
    m.add_argument(
        "--experts",
        type=int,
        default=None,
        help="with --arch hy-v4 (default 4) or deepseek-v4 (default 64)",
    )
    m.add_argument(
        "--experts-per-tok",
        type=int,
        default=None,
        help="with --arch hy-v4 (default 2) or deepseek-v4 (default 6)",
    )
    m.add_argument(
        "--window",
        type=int,
        default=128,
        help="with --arch deepseek-v4: the sliding window every layer attends to (default 128)",
    )
    m.add_argument(
        "--hc-mult",
        type=int,
        default=4,
        help="with --arch hy-v4 (iHC), deepseek-v4 or glm5-next --mhc: residual streams "
        "(default 4)",
    )
    m.add_argument(
        "--sink-logit",
        type=float,
        default=2.0,
        help="with --arch hy-v4 or deepseek-v4: mean of the per-head attention-sink logits, "
        "std 1 (default 2)",
    )
    m.add_argument(
        "--kda",
        action="store_true",
        help="with --arch glm5-next: KDA linear-attention layers in the checkpoint's pattern "
        "(every fourth layer MLA, the others KDA; needs --layers >= 4)",
    )
    m.add_argument(
        "--mhc",
        action="store_true",
        help="with --arch glm5-next: mHC hyper-connections over --hc-mult residual streams",
    )
    _soak_parser(sub)
    c = sub.add_parser(
        "kv-capacity",
        help="KV bytes per token and tokens a per-rank budget holds, per record format",
    )
    c.add_argument("--preset", default="glm-5", help="model geometry (its layer count)")
    c.add_argument("--layers", type=int, default=None, help="cached layers (default: preset's)")
    c.add_argument("--budget-gib", type=float, default=20.0, help="KV cache per rank, GiB")
    c.add_argument(
        "--tp",
        type=int,
        default=4,
        help="tensor parallel size (shown; MLA KV is replicated over TP)",
    )
    c.add_argument("--dcp", type=int, default=4, help="decode context parallel size")
    c.add_argument(
        "--index-bytes",
        type=int,
        default=DSA_INDEX_BYTES,
        help=f"indexer key bytes per token and layer (DSA: {DSA_INDEX_BYTES}; 0: none)",
    )
    c.add_argument("--json", action="store_true", help="print the rows as JSON only")
    sub.add_parser(
        "check-vllm",
        help="each patch target looked up in the installed vLLM (any version): per feature, "
        "whether it would apply and, where not, which target moved",
    )
    return parser


def _soak_parser(sub: argparse._SubParsersAction) -> None:
    d = SoakConfig()
    s = sub.add_parser(
        "soak", help="reload new weights N times: pair addresses, values and ledger each cycle"
    )
    s.add_argument("--cycles", type=int, default=d.cycles, help=f"default {d.cycles}")
    s.add_argument("--preset", default=d.preset, help=f"default {d.preset}")
    s.add_argument("--tp", type=int, default=d.tp, help=f"default {d.tp}")
    s.add_argument("--layers", type=int, default=d.layers, help=f"default {d.layers}")
    s.add_argument("--weights", default=d.weights, metavar="FORM", help=f"default {d.weights}")
    s.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"))
    s.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float32"))
    s.add_argument("--absorbed", default=d.absorbed, choices=("bf16", "direct"))
    s.add_argument("--no-release", action="store_true", help="keep the source after absorption")
    s.add_argument("--pool", type=int, default=d.pool, help="weight sets rotated through")
    s.add_argument("--seed", type=int, default=d.seed)
    s.add_argument("--no-replay", action="store_true", help="CUDA: no graph replay per cycle")
    s.add_argument("--json", action="store_true", help="print the report as JSON only")


def _bar(console: Console, unit: str = "layers"):
    def progress(label: str, total: int) -> Iterator[int]:
        columns = (
            TextColumn(f"{label:>8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(unit),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console, transient=True) as bar:
            yield from bar.track(range(total), total=total)

    return progress


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:,.1f}"


def _render(report: dict, console: Console) -> None:
    title = (
        f"{report['preset']}  TP{report['tp']} rank {report['rank']}  "
        f"{report['heads_per_rank']} heads/rank ({report['real_heads']} real)  "
        f"{report['layers']} layers  {report['weights']}  {report['device']}"
    )
    form = report["form"]
    table = Table(
        title=f"{title}\nmodels: {form['vllm']}; upstream dequant: {form['upstream']}",
        title_justify="left",
    )
    table.add_column("MiB per GPU")
    table.add_column("baseline", justify="right")
    table.add_column("lean", justify="right")
    table.add_column("lean - baseline", justify="right")
    base, lean = report["baseline"], report["lean"]
    rows = (
        ("absorbed (W_UK_T + W_UV)", "absorbed_bytes"),
        ("kv_b_proj source", "source_bytes"),
        ("packed owners", "packed_bytes"),
        ("resident after post-load", "resident_bytes"),
        ("peak transient (allocator)", "peak_transient_bytes"),
        ("reserved, unallocated", "reserved_unallocated_bytes"),
    )
    for label, key in rows:
        b, ln = base[key], lean[key]
        delta = None if b is None or ln is None else ln - b
        table.add_row(label, _mib(b), _mib(ln), "n/a" if delta is None else f"{delta / MIB:+,.1f}")
    console.print(table)
    console.print(
        f"reclaimed: {_mib(report['reclaimed_bytes'])} MiB per GPU "
        f"({report['reclaimed_bytes']:,} bytes); scratch bound "
        f"{_mib(report['scratch_bound_bytes'])} MiB ({_chunk(report)} per chunk); "
        f"{report['elapsed_s']:.1f} s"
    )
    pad = report["padding"]
    if pad["padded_heads_total"] != pad["heads"]:
        console.print(
            f"head padding: {pad['heads']} heads -> {pad['padded_heads_total']} at TP "
            f"{report['tp']} ({pad['padded_heads_on_rank']} on this rank): the absorbed pair "
            f"grows {_mib(pad['pair_bytes_on_rank'])} MiB on this rank, "
            f"{_mib(pad['pair_bytes_all_ranks'])} MiB on all ranks (vLLM: VLLM_MLA_TP_PAD=1)"
        )
    failed = set(failed_checks(report))
    for name, value in report["checks"].items():
        mark = "[red]FAIL[/]" if name in failed else "[green]ok[/]"
        if isinstance(value, bool) and not value and name not in failed:
            mark = "[dim]n/a[/]"
        console.print(f"  {mark:>18}  {name} = {value}")
    for note in report["notes"]:
        console.print(f"  note: {note}")
    records = ", ".join(
        f"{r['format']} {r['bytes_per_token_layer']:,}" for r in report.get("kv_records", [])
    )
    console.print(f"KV cache per token and layer: {records} bytes (vllm-mla kv-capacity: a pool)")


def _chunk(report: dict) -> str:
    if report.get("chunk_axis") == "cols":
        return f"{report['per_chunk']} latent columns"
    return f"{report['heads_per_chunk']} heads"


def _from_args(cls: type, args: argparse.Namespace, **extra: object) -> object:
    """``cls`` (a config dataclass) from the parsed options of its fields' names; ``extra``
    for the fields whose option says it another way (``--no-release``)."""
    names = {f.name for f in dataclasses.fields(cls)} - extra.keys()
    return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)}, **extra)


def _qualify(args: argparse.Namespace) -> int:
    cfg = _from_args(
        QualifyConfig,
        args,
        release=not args.no_release,
        max_scratch_bytes=int(args.max_scratch_mib * MIB),
    )
    plot = check_plot(args.plot) if args.plot else None  # fail before the long run
    # A duplicate of fd 2, so the progress bar survives AllocationTrace's capture of fd 2.
    err = Console(file=os.fdopen(os.dup(2), "w", buffering=1), stderr=True)
    progress = plain_progress if args.json or not err.is_terminal else _bar(err)
    timelines: dict | None = {} if plot else None
    report = run_qualify(cfg, progress, timelines)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _render(report, Console())
    if plot:
        write_plot(plot, report, timelines)
        # with --json, stdout carries the report alone
        print(f"wrote {plot}", file=sys.stderr if args.json else sys.stdout)
    return 1 if failed_checks(report) else 0


def _make_model(args: argparse.Namespace) -> int:
    spec = _from_args(TinyModelSpec, args)
    folder = make_model(args.path, spec)
    size = sum(f.stat().st_size for f in folder.iterdir())
    kind = f", DSA top-{spec.index_topk} of {spec.index_heads} index heads" if spec.dsa else ""
    if spec.arch == "hy-v4":
        kind = f", HY-V4{kind}, {spec.experts} experts, attention sink"
    if spec.arch == "glm5-next":
        kind = f", GLM-5.3-Flash{kind} over pools of {tiny_glm5next.KPOOL}, latent 512 no RoPE"
        if spec.kda:
            kinds = tiny_glm5next.layer_types(spec)
            kind += f", {kinds.count('linear_attention')} KDA layers"
        if spec.mhc:
            kind += f", mHC over {spec.hc_mult} streams"
    if spec.arch == "deepseek-v4":
        ratios = tiny_deepseekv4.compress_ratios(spec.layers)
        kind = (
            f", DeepSeek-V4: window {spec.window}, {ratios.count(tiny_deepseekv4.C4)} C4 layers "
            f"(indexer top-{spec.index_topk} of {spec.index_heads} heads), "
            f"{ratios.count(tiny_deepseekv4.C128)} C128, {spec.experts} experts, attention sink, "
            f"mHC over {spec.hc_mult} streams"
        )
    print(f"wrote {folder} ({size / MIB:.1f} MiB): {spec.layers} layers, {spec.heads} heads{kind}")
    return 0


def _soak(args: argparse.Namespace) -> int:
    cfg = _from_args(SoakConfig, args, release=not args.no_release, replay=not args.no_replay)
    err = Console(stderr=True)
    progress = None if args.json or not err.is_terminal else _bar(err, "cycles")
    report = run_soak(cfg, progress)
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0 if report.ok else 1
    console = Console()
    console.print(
        f"soak: {report.cycles} reload cycles x {report.layers} layers, {report.weights}, "
        f"{report.device}, {report.elapsed_s:.1f} s; resident {report.resident_bytes:,} bytes"
    )
    for name in ("pointer_moves", "value_mismatches", "ledger_growth_bytes"):
        console.print(f"  {name} = {getattr(report, name)}")
    for name in ("allocated_growth_bytes", "replay_mismatches"):
        value = getattr(report, name)
        console.print(f"  {name} = {'n/a (CPU)' if value is None else value}")
    for failure in report.failures:
        console.print(f"  [red]FAIL[/] {failure}")
    console.print("[green]ok[/]" if report.ok else "[red]soak failed[/]")
    return 0 if report.ok else 1


def _kv_capacity(args: argparse.Namespace) -> int:
    layers = args.layers or _preset(args.preset).num_layers
    rows = capacity(layers, args.budget_gib, args.dcp, args.index_bytes)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
        return 0
    table = Table(
        title=f"{args.preset}: {layers} layers, TP {args.tp} / DCP {args.dcp}, "
        f"{args.budget_gib:g} GiB of KV cache per rank, indexer {args.index_bytes} B"
    )
    for col in ("records", "B/token/layer", "tokens/GiB/layer", "B/token/rank", "context"):
        table.add_column(col, justify="left" if col == "records" else "right")
    base = rows[0].context_tokens
    for r in rows:
        table.add_row(
            r.kv_format,
            f"{r.record_bytes:,}",
            f"{r.tokens_per_gib_layer:,}",
            f"{r.bytes_per_token_rank:,.0f}",
            f"{r.context_tokens:,} ({r.context_tokens / base:.2f}x)",
        )
    table.caption = "; ".join(f"{r.kv_format}: {r.summary}" for r in rows)
    Console().print(table)
    return 0


def _preset(name: str):
    if name not in PRESETS:
        raise GeometryError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def _check_vllm(args: argparse.Namespace) -> int:
    """Exit 0 when every feature's targets are where the plugin expects them."""
    from vllm_mla.vllm import patches

    version = patches.vllm_version()
    if version is None:
        print("vllm-mla: vLLM is not importable here", file=sys.stderr)
        return 2
    known = patches.supported(version)
    print(
        f"vLLM {version}: "
        + (
            "supported (the plugin applies its features)"
            if known
            else f"not one of {', '.join(patches.SUPPORTED_VLLM)}: the plugin applies "
            f"nothing and warns once; judged against {patches.SUPPORTED_VLLM[-1]}'s targets"
        )
    )
    moved = 0
    for feature, outcomes in sorted(patches.check_targets().items()):
        bad = [(name, why) for name, why in outcomes if why.startswith("moved")]
        moved += len(bad)
        print(f"  {feature}: {'would apply' if not bad else 'would NOT apply'}")
        for name, why in outcomes:
            if why != "ok":
                print(f"    {name}: {why}")
    return 0 if moved == 0 else 1


COMMANDS = {
    "make-model": _make_model,
    "soak": _soak,
    "qualify": _qualify,
    "check-vllm": _check_vllm,
    "kv-capacity": _kv_capacity,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vllm-mla`` console script; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return COMMANDS[args.command](args)
    except USAGE_ERRORS as exc:
        print(f"vllm-mla: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
