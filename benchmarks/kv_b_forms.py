"""qualify over every row of the kv_b_proj matrix: resident, reclaimed and transient bytes.

Usage: python benchmarks/kv_b_forms.py [--preset glm-5] [--tp 4] [--layers K] [--device auto]
       [--json OUT]

One qualify run per row (baseline and lean side by side, as ``vllm-mla qualify --weights
ROW``); prints a Markdown table in MiB per GPU and, with ``--json``, the raw reports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import environment

from vllm_mla.tools.qualify import QualifyConfig, failed_checks, run_qualify
from vllm_mla.weights.forms import FORMS

MIB = 1 << 20


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f}"


def rows(preset: str, tp: int, layers: int | None, device: str) -> list[dict]:
    """One qualify report per matrix row."""
    out = []
    for f in FORMS:
        cfg = QualifyConfig(preset=preset, tp=tp, layers=layers, device=device, weights=f.name)
        report = run_qualify(cfg)
        report["failed_checks"] = failed_checks(report)
        out.append(report)
        print(f"  {f.name}: {report['elapsed_s']:.1f} s", file=sys.stderr)
    return out


def table(reports: list[dict]) -> str:
    lines = [
        "| form | resident baseline | resident lean | reclaimed | transient baseline | "
        "transient lean | scratch bound | bounded | checks |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in reports:
        base, lean = r["baseline"], r["lean"]
        checks = "ok" if not r["failed_checks"] else "FAILED " + ", ".join(r["failed_checks"])
        lines.append(
            f"| `{r['weights']}` | {_mib(base['resident_bytes'])} | {_mib(lean['resident_bytes'])} "
            f"| {_mib(r['reclaimed_bytes'])} | {_mib(base['peak_transient_bytes'])} | "
            f"{_mib(lean['peak_transient_bytes'])} | {_mib(r['scratch_bound_bytes'])} | "
            f"{'yes' if r['form']['scratch_bounded'] else 'kernel workspace not counted'} "
            f"| {checks} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="glm-5")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", help="write the raw reports here")
    args = parser.parse_args()
    reports = rows(args.preset, args.tp, args.layers, args.device)
    first = reports[0]
    print(
        f"{first['preset']} TP{first['tp']}, {first['layers']} layers, {first['device']}, "
        f"MiB per GPU ({environment()['date']})\n"
    )
    print(table(reports))
    if args.json:
        Path(args.json).write_text(json.dumps({"env": environment(), "rows": reports}, indent=1))
    return 1 if any(r["failed_checks"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
