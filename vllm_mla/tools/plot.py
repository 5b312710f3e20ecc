"""`vllm-mla qualify --plot FILE`: live bytes over post-load, baseline beside lean.

The curve is the allocator trace qualify already records (``AllocationTrace.timeline``),
the marks are the report's figures. matplotlib is the optional extra ``vllm-mla[plot]``
and is imported only here, only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path

MIB = 1 << 20
SUFFIXES = ("png", "svg", "pdf")
PHASES = ("baseline", "lean")
MISSING = "--plot needs matplotlib: pip install 'vllm-mla[plot]'"

Timeline = list[tuple[int, int, int]]  # (t_ns, live, transient) per allocator event


class PlotError(ValueError):
    """A plot that cannot be written; the message says why."""


def check_plot(path: str | Path) -> Path:
    """``path`` as a Path, or PlotError unless it ends in .png, .svg or .pdf, its folder
    exists and matplotlib imports; meant to run before the (long) qualify run."""
    path = Path(path)
    if path.suffix.lower().lstrip(".") not in SUFFIXES:
        raise PlotError(f"--plot {path}: the file must end in .{', .'.join(SUFFIXES)}")
    if not path.parent.is_dir():
        raise PlotError(f"--plot {path}: no folder {path.parent}")
    _figure_class()
    return path


def _figure_class():
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotError(MISSING) from exc
    return Figure


def plot_marks(report: dict, timelines: dict[str, Timeline]) -> dict[str, dict[str, int]]:
    """Per phase, what the figure marks: the persistent pair, the source kept and the
    scratch peak (the report's bytes), and where the scratch peaks on the curve: the first
    event holding ``peak_transient_bytes`` of scratch and the live bytes there."""
    marks = {}
    for phase in PHASES:
        side, points = report[phase], timelines[phase]
        peak = side["peak_transient_bytes"] or 0
        event, top = 0, 0
        for i, (_, live, transient) in enumerate(points, start=1):
            if transient == peak:
                event, top = i, live
                break
        marks[phase] = {
            "pair_bytes": side["absorbed_bytes"],
            "source_bytes": side["source_bytes"],
            "scratch_peak_bytes": peak,
            "scratch_event": event,
            "scratch_top_bytes": top,
        }
    return marks


def plot_title(report: dict) -> str:
    """The figure's title: preset, TP and rank, layers, form and pair, device."""
    return (
        f"post-load, one GPU: {report['preset']} TP{report['tp']} rank {report['rank']}, "
        f"{report['layers']} layers, {report['weights']} ({report['absorbed']} pair), "
        f"{report['device']}"
    )


def write_plot(
    path: str | Path, report: dict, timelines: dict[str, Timeline]
) -> dict[str, dict[str, int]]:
    """Write the figure to ``path`` (format from its suffix); returns ``plot_marks``, the
    values drawn. PlotError for a bad path or a missing matplotlib."""
    path = check_plot(path)
    marks = plot_marks(report, timelines)
    fig = _figure_class()(figsize=(11, 4.6), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, phase in zip(axes, PHASES, strict=True):
        _panel(ax, phase, report[phase], timelines[phase], marks[phase], report["layers"])
    axes[0].set_ylabel("MiB allocated since the phase started")
    fig.suptitle(plot_title(report), fontsize=11)
    if report["device"] == "cpu" and report["lean"]["source_bytes"] == 0:
        # torch's CPU allocator reports no size for blocks allocated before profiling began.
        fig.text(
            0.5,
            0.005,
            "CPU: the released source was allocated before the phase and torch reports no size "
            "for its free, so the curve does not drop there; the ledger (title) counts it.",
            ha="center",
            va="bottom",
            fontsize=8,
            color="0.35",
        )
        fig.get_layout_engine().set(rect=(0, 0.04, 1, 0.96))
    fig.savefig(path, format=path.suffix.lower().lstrip("."))
    return marks


def _curve(ax, x: list[int], points: Timeline, lw: float) -> None:
    live = [0] + [p[1] / MIB for p in points]
    held = [0] + [(p[1] - p[2]) / MIB for p in points]  # live less the scratch
    lo, hi = x[0], x[-1] + 1
    ax.fill_between(
        x,
        held[lo:hi],
        live[lo:hi],
        step="post",
        color="tab:orange",
        alpha=0.4,
        lw=0,
        label="scratch (freed again)",
    )
    ax.step(x, live[lo:hi], where="post", color="tab:blue", lw=lw, label="live bytes")


def _panel(ax, phase: str, side: dict, points: Timeline, mark: dict[str, int], layers: int) -> None:
    _curve(ax, list(range(len(points) + 1)), points, lw=1.2)
    pair, source = mark["pair_bytes"] / MIB, mark["source_bytes"] / MIB
    ax.axhline(pair, ls="--", color="tab:green", lw=1, label=f"persistent pair: {pair:,.1f} MiB")
    # The source was loaded before the phase, so it is not on the curve: a bar after the
    # last event stacks it on the pair, as it stays resident.
    n = max(1, len(points))
    kept = f"source kept: {source:,.1f} MiB" if source else "source kept: 0 (released)"
    ax.bar(n * 1.05, source, n * 0.06, pair, color="tab:red", alpha=0.3, label=kept)
    peak, top = mark["scratch_peak_bytes"] / MIB, mark["scratch_top_bytes"] / MIB
    ev = mark["scratch_event"]
    if peak:
        ax.vlines(ev, top - peak, top, color="tab:orange", lw=2.5)
        ax.plot([ev], [top], "v", color="tab:orange", label=f"scratch peak: {peak:,.1f} MiB")
    ax.set_title(f"{phase}: {side['resident_bytes'] / MIB:,.1f} MiB resident after", fontsize=10)
    ax.set_xlabel("allocator event in the phase")
    ax.set_xlim(0, n * 1.09)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    span = max((abs(p[1]) for p in points), default=0) / MIB
    if peak and peak < 0.05 * span:  # too thin to see at full scale: zoom on it
        _zoom(ax, points, ev, top, peak, max(1, len(points) // max(1, layers)))


def _zoom(ax, points: Timeline, ev: int, top: float, peak: float, per_layer: int) -> None:
    lo, hi = max(0, ev - per_layer), min(len(points), ev + per_layer)
    ins = ax.inset_axes((0.56, 0.06, 0.41, 0.27))
    _curve(ins, list(range(lo, hi + 1)), points, lw=1)
    ins.vlines(ev, top - peak, top, color="tab:orange", lw=2.5)
    ins.plot([ev], [top], "v", color="tab:orange")
    ins.set_xlim(lo, hi)
    ins.set_title(f"zoom: scratch peak {peak:,.1f} MiB, event {ev}", fontsize=7)
    ins.tick_params(labelsize=7)
    ins.grid(alpha=0.3)
