"""What every benchmark script reports beside its figures: the machine, and its HBM roof."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import torch


def environment() -> dict:
    """Date, commit, Python/torch/Triton versions and, with CUDA, the GPU and capability."""
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    with contextlib.suppress(ImportError):
        import triton

        env["triton"] = triton.__version__
    with contextlib.suppress(OSError):
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            check=False,
        ).stdout.strip()
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return env


def copy_bandwidth(device: torch.device | str) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 4 * 10 / (start.elapsed_time(end) / 1e3)


def graph_time_us(step, reps: int = 20) -> float:
    """Median per-replay time (us) of a CUDA graph that runs ``step`` once (warmed up on a
    side stream first, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]
