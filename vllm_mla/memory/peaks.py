"""Allocation traces from the allocator itself (never from shape arithmetic).

``AllocationTrace`` records every allocation and free made while it is open,
through torch.profiler's memory events: on CPU the CPU allocator, on CUDA the
caching allocator. Each event carries the address, so allocations freed inside
the window (transient: dequant scratch, temporaries) are told apart from those
that outlive it (persistent: the absorbed pair).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

# Lines the profiler itself writes to fd 2 on every start/stop; anything else is replayed.
PROFILER_NOISE = ("USDT:", "STAGE:", "Memory block of unknown size was allocated before")


@contextmanager
def _profiler_stderr_filtered() -> Iterator[None]:
    """Capture fd 2 while the profiler runs, then replay all but its own chatter."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines(keepends=True):
                if not any(marker in line for marker in PROFILER_NOISE):
                    sys.stderr.write(line)


@dataclass(frozen=True)
class Allocation:
    """One allocation seen in the window; ``freed`` if it was freed inside it too."""

    t_ns: int
    size: int
    device: str
    freed: bool


class AllocationTrace:
    """Context manager: allocations and frees in order, for one device type."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device_type = torch.device(device).type
        self._events: list[tuple[int, int, int]] = []  # (t_ns, ptr, signed bytes)
        self._profile: profile | None = None
        self._quiet = _profiler_stderr_filtered()

    def __enter__(self) -> AllocationTrace:
        # CPU activity alone: the allocators (CUDA's caching allocator too) report their
        # events through the host-side profiler; no CUPTI is needed for memory.
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._quiet.__enter__()
        try:
            self._profile.__enter__()
        except BaseException:
            self._quiet.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._profile is not None
        try:
            self._profile.__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)
        tree = self._profile.profiler.kineto_results.experimental_event_tree()
        self._events = sorted(self._collect(tree))
        self._profile = None

    def _collect(self, nodes: list) -> list[tuple[int, int, int]]:
        from torch._C._profiler import _EventType

        found = []
        stack = list(nodes)
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag != _EventType.Allocation:
                continue
            fields = node.extra_fields
            if torch.device(str(fields.device)).type == self.device_type:
                found.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        return found

    def _lifetimes(self) -> list[tuple[int, int | None, int]]:
        """(alloc event index, free event index or None, bytes) per allocation."""
        open_at: dict[int, int] = {}
        lifetimes: list[list] = []
        for i, (_, ptr, delta) in enumerate(self._events):
            if delta > 0:
                open_at[ptr] = len(lifetimes)
                lifetimes.append([i, None, delta])
            elif ptr in open_at:
                lifetimes[open_at.pop(ptr)][1] = i
        return [tuple(x) for x in lifetimes]

    def allocations(self) -> list[Allocation]:
        """Allocations in time order, each marked freed-in-window or not."""
        return [
            Allocation(self._events[a][0], size, self.device_type, freed=f is not None)
            for a, f, size in self._lifetimes()
        ]

    def transient_peak(self) -> int:
        """Most bytes live at once among allocations that were freed inside the window."""
        return max((transient for _, _, transient in self.timeline()), default=0)

    def timeline(self) -> list[tuple[int, int, int]]:
        """(t_ns, live, transient) after each event, in order: ``live`` is the net bytes
        since the window opened as the allocator reported them (a free of a block allocated
        before the window counts, where the allocator reports its size); ``transient`` is the
        part of it held by allocations freed inside the window, so its maximum is
        ``transient_peak()`` and the last ``live`` is ``persistent_bytes()`` less the
        pre-window blocks freed."""
        transient_delta = [0] * len(self._events)
        for a, f, size in self._lifetimes():
            if f is not None:
                transient_delta[a] += size
                transient_delta[f] -= size
        points = []
        live = transient = 0
        for (t_ns, _, delta), t_delta in zip(self._events, transient_delta, strict=True):
            live += delta
            transient += t_delta
            points.append((t_ns, live, transient))
        return points

    def persistent_bytes(self) -> int:
        """Bytes allocated in the window and still alive at its end."""
        return sum(a.size for a in self.allocations() if not a.freed)
